"""Speculative decoding "never slower": each variant against drafting off in paired rounds.

Why: run.py serves one system after another, each through every scenario, and this VM drifts
by 10-20% over minutes: the same system's s2 has read 282-349 tok/s between runs, and a
variant that drafted twice (2 draft tokens in all) read 16% slower at s3 than the system run
first. Here every round starts a fresh server per system, in an order rotated each round, and
each variant is read against the off server of the same round; the medians over rounds are
the figures. Both clients (ours, then vLLM's `bench serve`) on every scenario. The first of
--systems is the baseline (drafting off) the others are read against.

Usage: .venv/bin/python benchmarks/spec_paired.py [--rounds 3] [--scenarios s2,s3,s12]
       [--systems kvserve,kvserve-ngram,kvserve-suffix] [--name spec-paired]
Writes benchmarks/results/<cpu>/<date>-<name>.{md,json}, the rounds' raw results under
<date>-<name>/round-<r>/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run  # noqa: E402  (benchmarks/run.py: servers, scenarios, clients)

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header  # noqa: E402
from kvserve.bench.results import write_dated_result  # noqa: E402
from kvserve.bench.run_report import VLLM_CLIENT_KEY  # noqa: E402

CLIENTS = {"ours": "scenarios", "vLLM's": VLLM_CLIENT_KEY}


def rotated(systems: list[str], round_index: int) -> list[str]:
    """The round's order: each system goes first in turn (drift does not favour one)."""
    shift = round_index % len(systems)
    return systems[shift:] + systems[:shift]


def measure(systems: list[str], scenarios: list[str], rounds: int, port: int,
            out_dir: Path) -> list[dict]:
    clients = ("kvserve", "vllm") if run.vllm_client.available() else ("kvserve",)
    records = []
    for round_index in range(rounds):
        round_dir = out_dir / f"round-{round_index + 1}"
        round_dir.mkdir(parents=True, exist_ok=True)
        for name in rotated(systems, round_index):
            try:
                record = run.run_system(name, port, round_dir, scenarios, clients)
            except Exception as exc:  # reported in its round, not fatal (as run.py's run_all)
                print(f"round {round_index + 1}, {name}: {exc}", file=sys.stderr)
                record = {"system": name, "scenarios": {}, "error": str(exc)}
            record["round"] = round_index + 1
            records.append(record)
    return records


def load_records(out_dir: Path, systems: list[str], scenarios: list[str]) -> list[dict]:
    """The records of the rounds saved under out_dir (for --report-only: a run stopped early,
    or a table rewritten), as `measure` returns them."""
    records = []
    for round_dir in sorted(out_dir.glob("round-*"), key=lambda p: int(p.name.split("-")[1])):
        for name in systems:
            record = {"system": name, "round": int(round_dir.name.split("-")[1]),
                      "scenarios": {}, VLLM_CLIENT_KEY: {}}
            for scenario in scenarios:
                ours = round_dir / f"{name}-{scenario}.json"
                theirs = round_dir / f"{name}-{scenario}.vllm.json"
                if ours.exists():
                    record["scenarios"][scenario] = json.loads(ours.read_text())["summary"]
                if theirs.exists():
                    record[VLLM_CLIENT_KEY][scenario] = run.vllm_client.summary(
                        json.loads(theirs.read_text()))
            if record["scenarios"]:
                records.append(record)
    return records


def ratios(records: list[dict], scenario: str, client_key: str, metric: str,
           baseline: str) -> dict:
    """Per variant, each round's variant / `baseline` (drafting off) of that round: output
    tok/s, or TPOT p50 read as off / variant (above 1 is faster either way)."""
    by_round: dict[int, dict[str, dict]] = {}
    for record in records:
        summary = record.get(client_key, {}).get(scenario)
        if summary:
            by_round.setdefault(record["round"], {})[record["system"]] = summary
    out: dict[str, list[float]] = {}
    for systems in by_round.values():
        base = systems.get(baseline)
        if base is None:
            continue
        for name, summary in systems.items():
            if name == baseline:
                continue
            if metric == "tput":
                value = summary["output_throughput"] / base["output_throughput"]
            else:
                value = base["tpot_s"]["p50"] / summary["tpot_s"]["p50"]
            out.setdefault(name, []).append(value)
    return out


def markdown(records: list[dict], args, header: dict) -> list[str]:
    baseline, *variants = args.systems.split(",")
    lines = [f"# {args.title}, paired rounds", "",
             f"CPU: {cpu_label(header)}. {args.rounds} rounds; each a fresh server per system, "
             f"the order rotated each round; each variant read against the {baseline} server "
             "of its round (above 1: faster). Medians over rounds, then each round's ratio. "
             "`benchmarks/spec_paired.py`.", "",
             "| scenario | client | metric | " + " | ".join(variants) + " |",
             "|---|---|---|" + "---|" * len(variants)]
    for scenario in args.scenarios.split(","):
        for client, key in CLIENTS.items():
            for metric, label in (("tput", "out tok/s"), ("tpot", "TPOT p50")):
                found = ratios(records, scenario, key, metric, baseline)
                if not found:
                    continue
                cells = []
                for name in variants:
                    values = found.get(name, [])
                    cells.append(f"**{statistics.median(values):.3f}** ("
                                 + ", ".join(f"{v:.2f}" for v in values) + ")"
                                 if values else "-")
                lines.append(f"| {scenario} | {client} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "Drafts per scenario and round (ours, from the server's counters):", ""]
    for record in records:
        for scenario, summary in record.get("scenarios", {}).items():
            server = summary.get("server", {})
            if record["system"] != baseline and "spec_decode_num_draft_tokens" in server:
                lines.append(f"- round {record['round']} {record['system']} {scenario}: "
                             f"{server['spec_decode_num_draft_tokens']:.0f} draft tokens, "
                             f"{server['spec_decode_num_accepted_tokens']:.0f} accepted")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="kvserve,kvserve-ngram,kvserve-suffix",
                        help="the baseline (drafting off) first, then the variants")
    parser.add_argument("--scenarios", default="s2,s3,s12")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8120)
    parser.add_argument("--name", default="spec-paired")
    parser.add_argument("--title", default="Speculative decoding against drafting off",
                        help="the table's heading (other variants than drafting: LoRA)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the table from the rounds saved under today's --name")
    args = parser.parse_args()
    if len(args.systems.split(",")) < 2:
        parser.error("--systems: the baseline (drafting off) first, then at least one variant")
    run.cap_torch_to_avx2()
    header = machine_header()
    out_dir = (run.RESULTS / cpu_slug(header)
               / f"{datetime.date.today().isoformat()}-{args.name}")
    if args.report_only:
        records = load_records(out_dir, args.systems.split(","), args.scenarios.split(","))
        args.rounds = len({record["round"] for record in records})
    else:
        records = measure(args.systems.split(","), args.scenarios.split(","), args.rounds,
                          args.port, out_dir)
    path = write_dated_result(run.RESULTS, header, args.name, records,
                              markdown(records, args, header))
    print(path.read_text())


if __name__ == "__main__":
    main()
