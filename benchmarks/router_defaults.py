"""`kvserve router` in front of two real-model replicas started with no flags but their port
(issue 34's must-show, on SmolLM2-135M-Instruct rather than the tests' tiny model): six
interleaved sessions of four turns; the share of the reusable prompt tokens (each turn's earlier
context, in full blocks) that came back cached, with the replicas' default KV events and with
events disabled on them (the router's approximate index).

Usage: .venv/bin/python benchmarks/router_defaults.py [--sessions 6] [--turns 4] [--name NAME]
Results: benchmarks/results/<cpu>/<name>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.testing.server import ServerProcess
from kvserve.testing.sessions import interleaved_sessions

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"default": (), "disabled": ("--kv-events-config", '{"enable_kv_cache_events": false}')}


def run_mode(extra: tuple[str, ...], args, logs: Path, mode: str) -> dict:
    """Two replicas (one torch thread each: 2 cores) and a router with its defaults."""
    servers = [ServerProcess(["--num-threads", "1", *extra], log_path=logs / f"{mode}-{i}.log")
               for i in range(2)]
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.__enter__()
        router_args = [flag for server in servers for flag in ("--replica", server.base_url)]
        with ServerProcess(router_args, subcommand="router",
                           log_path=logs / f"{mode}-router.log") as router:
            deadline = time.monotonic() + 120
            while True:
                state = httpx.get(router.base_url + "/router/state").json()["replicas"]
                key = "synced" if mode == "default" else "approximate_index"
                if all(s["healthy"] and s[key] for s in state.values()):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replicas not ready: {state}")
                time.sleep(0.2)
            start = time.monotonic()
            share = interleaved_sessions(router.base_url, args.sessions, args.turns,
                                         think_seconds=0.3, max_tokens=args.output_len)
            return {"mode": mode, "cached_share": share,
                    "kv_events": [s["kv_events"] for s in state.values()],
                    "seconds": time.monotonic() - start}
    finally:
        for server in servers:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-router-defaults")
    args = parser.parse_args()
    header = machine_header()
    out = RESULTS / cpu_slug(header)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="router-defaults-"))  # the servers' logs, if wanted
    rows = [run_mode(extra, args, logs, mode) for mode, extra in MODES.items()]
    (out / f"{args.name}.json").write_text(json.dumps({"machine": header, "rows": rows},
                                                      indent=1))
    lines = [f"# kvserve router over two default replicas ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {cpu_label(header)}. Model: SmolLM2-135M-Instruct (the default). "
             f"Replicas: `kvserve serve --port P --num-threads 1` (plus the events-off flag "
             f"in the second row); router: `kvserve router --replica A --replica B`. Workload: "
             f"{args.sessions} sessions x {args.turns} turns asked round by round "
             f"(kvserve/testing/sessions.py), {args.output_len}-token answers.", "",
             "| replicas' KV events | reusable prompt tokens cached | run s |", "|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['mode']} | {100 * row['cached_share']:.1f}% | "
                     f"{row['seconds']:.0f} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
