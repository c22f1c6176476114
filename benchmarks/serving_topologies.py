"""Serving topologies behind `kvserve router`, measured with `kvserve bench serve`.

Two experiments, each on real servers of the default model (SmolLM2-135M-Instruct), each
server with one torch thread (2 cores: two servers, one core each):

- `routing`: two aggregated replicas, a multi-turn workload (sessions sharing a system prompt,
  each with its own growing history); the router's policy kv-aware vs round-robin vs
  least-loaded, fresh replicas for each. Reported: the replicas' prefix-cache hit rate, TTFT
  p50/p99 (all turns and later turns), and the router's placement accuracy against the
  replicas' own count of prefix blocks (--measure-placement).
- `disagg`: a mixed workload (short chats, a long prompt every 8th request) on two aggregated
  replicas vs one prefill + one decode server (disaggregated mode). Reported: TTFT and ITL
  p50/p99, TPOT, throughput.

Usage: .venv/bin/python benchmarks/serving_topologies.py {routing,disagg,all} [--name NAME]
       [--sessions 16] [--turns 6] [--requests 32] [--long-len 1536]
Results: benchmarks/results/<cpu>/<name>-{routing,disagg}.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.cli import main as kvserve_main
from kvserve.testing.server import ServerProcess, kv_events_config

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("kv-aware", "round-robin", "least-loaded")


def _server(logs: Path, name: str, *flags: str) -> ServerProcess:
    return ServerProcess(["--num-threads", "1", "--no-adaptive-threads",
                          "--disable-log-requests", "--kv-events-config", kv_events_config(), *flags],
                         log_path=logs / f"{name}.log")


@contextmanager
def _deployment(logs: Path, servers: dict[str, tuple[str, ...]], router_flags: list[str]):
    """Servers by name -> their extra flags (started together), and a router given
    `router_flags` plus a --replica/--prefill/--decode URL per server (by its name's role)."""
    with ExitStack() as stack:
        processes = {name: _server(logs, name, *flags) for name, flags in servers.items()}
        for process in processes.values():
            process.start()
        for process in processes.values():
            stack.enter_context(process)
        args = ["--disable-log-requests", *router_flags]
        for name, process in processes.items():
            args += [f"--{name.rstrip('0123456789')}", process.base_url]
        router = stack.enter_context(ServerProcess(args, subcommand="router",
                                                   log_path=logs / "router.log"))
        deadline = time.monotonic() + 60
        while True:
            state = httpx.get(router.base_url + "/router/state", timeout=5).json()["replicas"]
            if all(s["healthy"] and s["synced"] for s in state.values()):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not ready: {state}")
            time.sleep(0.2)
        yield router


def _bench(base_url: str, label: str, out: Path, *flags: str) -> dict:
    code = kvserve_main(["bench", "serve", "--base-url", base_url, "--label", label,
                         "--no-progress", "--output-json", str(out), *flags])
    row = json.loads(out.read_text())
    row["exit_code"] = code
    return row


def _ms(summary: dict, key: str, stat: str) -> str:
    return f"{1000 * summary[key][stat]:.0f}"


def routing(args, work: Path) -> tuple[list[str], list[dict]]:
    workload = ["--workload", "multi-turn", "--num-prompts", str(args.sessions), "--turns",
                str(args.turns), "--system-prompt-len", "256", "--input-len", "64",
                "--output-len", str(args.output_len), "--max-concurrency",
                str(args.sessions)]
    rows = []
    for policy in POLICIES:
        with _deployment(work, {"replica0": (), "replica1": ()},
                         ["--policy", policy, "--measure-placement", "--seed", "0"]) as router:
            rows.append(_bench(router.base_url, policy, work / f"{policy}.json", *workload))
    lines = [f"Workload: `kvserve bench serve {' '.join(workload)}` through `kvserve router "
             f"--policy P --measure-placement` over 2 replicas (`kvserve serve --num-threads 1 "
             f"--kv-events-config ...`), fresh replicas per policy.", "",
             "| policy | requests ok | prefix-cache hit rate | placement best | chosen/best "
             "blocks | TTFT p50 ms | TTFT p99 ms | later-turn TTFT p50 ms | later-turn TTFT "
             "p99 ms | TPOT p50 ms | output tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s, server = row["summary"], row["summary"]["server"]
        lines.append(
            f"| {row['system']} | {s['completed']} | {100 * server['prefix_cache_hit_rate']:.1f}%"
            f" | {server['placement_best']:.0f}/{server['placement_decisions']:.0f} "
            f"({100 * server['placement_accuracy']:.0f}%) | "
            f"{server['placement_chosen_blocks']:.0f}/{server['placement_best_blocks']:.0f} | "
            f"{_ms(s, 'ttft_s', 'p50')} | {_ms(s, 'ttft_s', 'p99')} | "
            f"{_ms(s, 'ttft_later_turns_s', 'p50')} | {_ms(s, 'ttft_later_turns_s', 'p99')} | "
            f"{_ms(s, 'tpot_s', 'p50')} | {s['output_throughput']:.1f} |")
    return lines, rows


def disagg(args, work: Path) -> tuple[list[str], list[dict]]:
    workload = ["--workload", "long-prompt", "--num-prompts", str(args.requests),
                "--input-len", "64", "--output-len", str(args.output_len), "--long-len",
                str(args.long_len), "--request-rate", str(args.request_rate), "--seed", "0"]
    topologies = {
        "2 aggregated (kv-aware)": ({"replica0": (), "replica1": ()}, []),
        "1 prefill + 1 decode": ({"prefill0": ("--kv-role", "prefill"),
                                  "decode0": ("--kv-role", "decode")}, []),
    }
    rows = []
    for label, (servers, flags) in topologies.items():
        with _deployment(work, servers, ["--seed", "0", *flags]) as router:
            rows.append(_bench(router.base_url, label, work / f"{len(rows)}.json", *workload))
    lines = [f"Workload: `kvserve bench serve {' '.join(workload)}` (short chats, a "
             f"{args.long_len}-token prompt every 8th request, Poisson arrivals) through "
             f"`kvserve router`; each server `--num-threads 1`.", "",
             "| topology | requests ok | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
             "| TPOT p50 ms | TPOT p99 ms | output tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s = row["summary"]
        lines.append(f"| {row['system']} | {s['completed']} | {_ms(s, 'ttft_s', 'p50')} | "
                     f"{_ms(s, 'ttft_s', 'p99')} | {_ms(s, 'itl_s', 'p50')} | "
                     f"{_ms(s, 'itl_s', 'p99')} | {_ms(s, 'tpot_s', 'p50')} | "
                     f"{_ms(s, 'tpot_s', 'p99')} | {s['output_throughput']:.1f} |")
    return lines, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", choices=["routing", "disagg", "all"])
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-topologies")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=2.0)
    args = parser.parse_args()
    header = machine_header()
    out_dir = RESULTS / cpu_slug(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    experiments = ("routing", "disagg") if args.experiment == "all" else (args.experiment,)
    for experiment in experiments:
        with tempfile.TemporaryDirectory() as work:
            lines, rows = {"routing": routing, "disagg": disagg}[experiment](args, Path(work))
        text = "\n".join([f"# {experiment}: {args.name}", "",
                          f"CPU: {cpu_label(header)}, 2 cores. Command: `.venv/bin/python "
                          f"benchmarks/serving_topologies.py {experiment}`.", "", *lines]) + "\n"
        print(text)
        (out_dir / f"{args.name}-{experiment}.md").write_text(text)
        for row in rows:
            row.pop("per_request", None)
        (out_dir / f"{args.name}-{experiment}.json").write_text(json.dumps(
            {"machine": header, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
