"""Ray Serve's request routers on the same engine replicas and the same multi-turn workload.

Ours (`kv-aware`: the blocks each engine reports caching in its KV events, against its load)
against Ray Serve LLM's `prefix-cache-affinity` (PrefixCacheAffinityRouter: a character prefix
tree of the prompts it routed, never told what an engine evicted) and Ray Serve's default
`power-of-two-choices`. For each router a fresh `kvserve serve --replicas 2 --request-router R
--measure-placement` (its own local Ray; each replica one torch thread, so two replicas share
the 2 cores one each), warmed up until both replicas have answered, then `kvserve bench serve
--workload multi-turn` (sessions sharing a system prompt, each with its own growing history).
Reported: the engines' prefix-cache hit rate, placement accuracy against the engines' own count
of cached prefix blocks (the ingress probes every replica before each request), TTFT p50/p99
of all turns and of later turns, TPOT, output throughput.

Usage: .venv/bin/python benchmarks/ray_serve_routers.py [--router NAME[:JSON kwargs]]...
       [--sessions 16] [--turns 6] [--system-prompt-len 256] [--input-len 64]
       [--output-len 64] [--name NAME]
(default routers: kv-aware, prefix-cache-affinity with Ray's defaults, power-of-two-choices)
Results: benchmarks/results/<cpu>/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.cli import main as kvserve_main
from kvserve.ray_serve.config import REQUEST_ROUTERS
from kvserve.testing.server import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_ROUTERS = ("kv-aware", "prefix-cache-affinity", "power-of-two-choices")
REPLICAS = 2
SERVER_FLAGS = ["--replicas", str(REPLICAS), "--num-threads", "1", "--no-adaptive-threads",
                "--measure-placement", "--disable-log-requests"]


def _warm_up(base_url: str, timeout: float = 120.0) -> None:
    """Rounds of concurrent short requests until every replica has answered one (the ingress
    learns where to probe a replica from its answers). Concurrent, because with every queue
    empty power-of-two-choices keeps picking the same replica; texts differing from their
    first character, because Ray's prefix tree would send matching texts to one replica."""
    answered: set[str] = set()
    deadline = time.monotonic() + timeout

    def one(serial: int) -> str:
        response = httpx.post(base_url + "/v1/completions", timeout=60,
                              json={"prompt": f"{serial} warm-up", "max_tokens": 8})
        response.raise_for_status()
        return response.headers["x-kvserve-replica"]

    with ThreadPoolExecutor(2 * REPLICAS) as pool:
        for round_start in itertools.count(0, 2 * REPLICAS):
            answered.update(pool.map(one, range(round_start, round_start + 2 * REPLICAS)))
            if len(answered) >= REPLICAS:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {sorted(answered)} answered")


def router_flags(spec: str) -> list[str]:
    """"name" or "name:{json kwargs}" -> the serve flags."""
    name, _, kwargs = spec.partition(":")
    if name not in REQUEST_ROUTERS:
        raise SystemExit(f"unknown router {name!r}; choose from {', '.join(REQUEST_ROUTERS)}")
    return ["--request-router", name] + (["--request-router-kwargs", kwargs] if kwargs else [])


def run_router(spec: str, workload: list[str], work: Path, serial: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray each
    server = ServerProcess([*SERVER_FLAGS, *router_flags(spec)], startup_timeout=300,
                           log_path=work / f"{serial}.log", env=env)
    with server:
        _warm_up(server.base_url)
        out = work / f"{serial}.json"
        code = kvserve_main(["bench", "serve", "--base-url", server.base_url, "--label", spec,
                             "--no-progress", "--output-json", str(out), *workload])
    row = json.loads(out.read_text())
    row["exit_code"] = code
    row["server_exit_code"] = server.exit_code
    return row


def _ms(summary: dict, key: str, stat: str) -> str:
    return f"{1000 * summary[key][stat]:.0f}"


def table(rows: list[dict]) -> list[str]:
    lines = ["| request router | requests ok | prefix-cache hit rate | placement best | "
             "chosen/best blocks | TTFT p50 / p99 ms | later-turn TTFT p50 / p99 ms | "
             "TPOT p50 ms | output tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s, server = row["summary"], row["summary"]["server"]
        decisions = server.get("placement_decisions") or 0
        placement = (f"{server['placement_best']:.0f}/{decisions:.0f} "
                     f"({100 * server['placement_accuracy']:.0f}%)" if decisions else "-")
        blocks = (f"{server['placement_chosen_blocks']:.0f}/"
                  f"{server['placement_best_blocks']:.0f}" if decisions else "-")
        lines.append(
            f"| {row['system']} | {s['completed']} | "
            f"{100 * server['prefix_cache_hit_rate']:.1f}% | {placement} | {blocks} | "
            f"{_ms(s, 'ttft_s', 'p50')} / {_ms(s, 'ttft_s', 'p99')} | "
            f"{_ms(s, 'ttft_later_turns_s', 'p50')} / {_ms(s, 'ttft_later_turns_s', 'p99')} | "
            f"{_ms(s, 'tpot_s', 'p50')} | {s['output_throughput']:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--router", action="append", dest="routers", metavar="NAME[:JSON]",
                        help=f"repeatable; one of {', '.join(REQUEST_ROUTERS)}, optionally "
                        f"with request_router_kwargs, e.g. 'prefix-cache-affinity:"
                        f"{{\"imbalanced_threshold\": 20}}' (default: "
                        f"{', '.join(DEFAULT_ROUTERS)})")
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-ray-serve-routers")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-prompt-len", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    routers = args.routers or list(DEFAULT_ROUTERS)
    for spec in routers:
        router_flags(spec)  # a typo fails now, not after the first run
    workload = ["--workload", "multi-turn", "--num-prompts", str(args.sessions), "--turns",
                str(args.turns), "--system-prompt-len", str(args.system_prompt_len),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--max-concurrency", str(args.sessions)]
    header = machine_header()
    out_dir = RESULTS / cpu_slug(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        rows = [run_router(spec, workload, Path(work), serial)
                for serial, spec in enumerate(routers)]
    import ray

    text = "\n".join([
        f"# Ray Serve request routers: {args.name}", "",
        f"CPU: {cpu_label(header)}, {header['cores']} cores; Ray {ray.__version__}. Command: "
        f"`.venv/bin/python benchmarks/ray_serve_routers.py "
        f"{' '.join(f'--router {shlex.quote(spec)}' for spec in routers)} "
        f"--sessions {args.sessions} --turns {args.turns} --system-prompt-len "
        f"{args.system_prompt_len} --input-len {args.input_len} --output-len "
        f"{args.output_len}`.", "",
        f"Workload: `kvserve bench serve {' '.join(workload)}` against `kvserve serve "
        f"{' '.join(SERVER_FLAGS)} --request-router R` (the default model), a fresh local Ray "
        f"and fresh replicas per router.", "", *table(rows)]) + "\n"
    print(text)
    (out_dir / f"{args.name}.md").write_text(text)
    for row in rows:
        row.pop("per_request", None)
    (out_dir / f"{args.name}.json").write_text(json.dumps({"machine": header, "runs": rows},
                                                          indent=1))


if __name__ == "__main__":
    main()
