"""KV offload tiers on the agent-sessions workload (issue 34): many sessions whose contexts grow
turn by turn, each revisited after all the others, with a working set many times the KV pool.

The same workload, greedy, on four servers of the default model started one after another:
tiers off, a RAM tier, a disk tier, and the disk tier again after a restart (a new server on
the folder the third one filled). With `--identity`, the first server is instead one without
tiers whose pool holds every session (nothing is ever recomputed), run one request at a time:
a tier restores the KV bytes it saved, so with the same KV and the same batches the answers
must be the same as that pool's (recomputing evicted KV, as tiers off does, is not bit-equal
to the KV computed first: decode steps and prefills round differently; add --concurrency 1
so the batches are the same too). Reported: TTFT p50/p99 (all turns and later turns), output
throughput, the prompt tokens that came back cached (usage), and how many answers are the
same text as the first server's.

Usage: .venv/bin/python benchmarks/kv_tiers.py [--sessions 100] [--turns 4] [--name NAME]
       [--identity --concurrency 1] [--server-flags "--dtype float32 --quantization none"]
Results: benchmarks/results/<cpu>/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.cli import main as kvserve_main
from kvserve.testing.server import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results"
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2's K and V a token, bfloat16


def _bench(base_url: str, label: str, out: Path, args) -> dict:
    code = kvserve_main(["bench", "serve", "--base-url", base_url, "--label", label,
                         "--no-progress", "--output-json", str(out),
                         "--workload", "agent-sessions", "--num-prompts", str(args.sessions),
                         "--turns", str(args.turns), "--input-len", str(args.input_len),
                         "--output-len", str(args.output_len),
                         "--max-concurrency", str(args.concurrency)])
    row = json.loads(out.read_text())
    row["exit_code"] = code
    return row


def _run(label: str, flags: list[str], work: Path, args, pool_bytes: int | None = None) -> dict:
    server = ServerProcess(["--disable-log-requests", "--kv-cache-memory-bytes",
                            str(pool_bytes or args.pool_bytes), *args.server_flags.split(),
                            *flags],
                           log_path=work / f"{label}.log")
    with server:
        started = time.monotonic()
        row = _bench(server.base_url, label, work / f"{label}.json", args)
        row["wall_s"] = time.monotonic() - started
    return row


def _ms(summary: dict, key: str, stat: str) -> str:
    values = summary.get(key) or {}
    return f"{1000 * values[stat]:.0f}" if stat in values else "-"


def _same_answers(row: dict, reference: dict) -> str:
    ours = [r.get("output_text") for r in row["per_request"]]
    theirs = [r.get("output_text") for r in reference["per_request"]]
    same = sum(a == b for a, b in zip(ours, theirs))
    return f"{same}/{len(theirs)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-kv-tiers")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=160)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool-bytes", type=int, default=128 << 20)
    parser.add_argument("--tier-bytes", type=int, default=4 << 30)
    parser.add_argument("--identity", action="store_true",
                        help="the reference is a pool that holds everything (see above)")
    parser.add_argument("--server-flags", default="",
                        help="more `kvserve serve` flags for every server, e.g. the float32 "
                        "configuration whose greedy tokens do not depend on how a prompt's "
                        "KV was computed")
    args = parser.parse_args()
    header = machine_header()
    out_dir = RESULTS / cpu_slug(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    with tempfile.TemporaryDirectory() as work_dir, \
            tempfile.TemporaryDirectory() as disk:
        work = Path(work_dir)
        disk_flags = ["--kv-offload-disk-dir", disk, "--kv-offload-disk-bytes",
                      str(args.tier_bytes)]
        reference = ("roomy-pool", [], args.tier_bytes) if args.identity else ("off", [], None)
        for label, flags, pool in (reference,
                                   ("ram", ["--kv-offload-ram-bytes", str(args.tier_bytes)],
                                    None),
                                   ("disk", disk_flags, None),
                                   ("disk-restarted", disk_flags, None)):
            rows[label] = _run(label, flags, work, args, pool)
            print(label, json.dumps({k: rows[label]["summary"].get(k) for k in
                                     ("output_throughput", "failed")}), flush=True)
    reference_label = next(iter(rows))
    working_set = rows[reference_label]["summary"]["prompt_tokens"]
    lines = [f"# KV offload tiers: {args.name}", "",
             f"CPU: {cpu_label(header)}, 2 cores. Command: `.venv/bin/python "
             f"benchmarks/kv_tiers.py --sessions {args.sessions} --turns {args.turns}"
             f"{' --server-flags ' + repr(args.server_flags) if args.server_flags else ''}"
             f"{' --identity' if args.identity else ''} --concurrency {args.concurrency}` "
             f"(turns of {args.input_len} tokens, answers of {args.output_len}, "
             f"{args.concurrency} at a time; each round asks every session's next turn). "
             f"KV pool {args.pool_bytes >> 20} MiB (~{args.pool_bytes // BYTES_PER_TOKEN} "
             f"tokens); tiers {args.tier_bytes >> 20} MiB each. Prompt tokens sent per run: "
             f"{working_set:.0f}.", "",
             "| tiers | TTFT p50 ms | TTFT p99 ms | later turns TTFT p50 ms | later turns "
             "TTFT p99 ms | out tok/s | cached prompt tokens (usage) | answers as "
             f"{reference_label} |",
             "|---|---|---|---|---|---|---|---|"]
    for label, row in rows.items():
        summary = row["summary"]
        lines.append(f"| {label} | {_ms(summary, 'ttft_s', 'p50')} | "
                     f"{_ms(summary, 'ttft_s', 'p99')} | "
                     f"{_ms(summary, 'ttft_later_turns_s', 'p50')} | "
                     f"{_ms(summary, 'ttft_later_turns_s', 'p99')} | "
                     f"{summary['output_throughput']:.1f} | "
                     f"{summary['cached_tokens'] / summary['prompt_tokens']:.1%} | "
                     f"{_same_answers(row, rows[reference_label])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (out_dir / f"{args.name}.md").write_text(text)
    (out_dir / f"{args.name}.json").write_text(json.dumps(
        {"machine": header, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
