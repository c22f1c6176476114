"""Before/after check for a change that must not cost speed: the same kvserve scenarios served
from two checkouts (e.g. the commit before an issue and main), alternated A B A B so drift on
the machine hits both alike, with this checkout's bench client. Writes
benchmarks/results/<cpu-slug>/<name>.md and <name>.json: per round and median, s1's TPOT and
s2's output throughput, and the ratio after/before.

Usage: .venv/bin/python benchmarks/compare_commits.py --before /path/to/old/checkout
           [--after .] [--rounds 2] [--scenarios s1,s2] --name 2026-11-25-issue29
Each checkout needs its kernels built (`python -m kvserve.kernels` there); both run on this
venv's packages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from run import PY, RESULTS, SCENARIOS, stop_server, wait_healthy

METRICS = {  # scenario -> (label, how to read it from a summary, higher is better)
    "s1": ("TPOT p50 (ms)", lambda s: 1000 * s["tpot_s"]["p50"], False),
    "s2": ("output tok/s", lambda s: s["output_throughput"], True),
    "s3": ("TTFT p50 (ms)", lambda s: 1000 * s["ttft_s"]["p50"], False),
}


def git_commit(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def serve_and_measure(checkout: Path, port: int, scenarios: list[str], out_dir: Path,
                      label: str, server_args: list[str] = ()) -> dict[str, dict]:
    """Start `kvserve serve` from `checkout` (its own package first on the path), run each
    scenario with this checkout's client, stop it; the summaries by scenario."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    base_url = f"http://127.0.0.1:{port}"
    summaries = {}
    with open(out_dir / f"{label}.server.log", "wb") as log:
        process = subprocess.Popen([PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                    "--disable-log-requests", *server_args], cwd=checkout,
                                   env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(base_url, process, timeout=900)
            for scenario in scenarios:
                path = out_dir / f"{label}-{scenario}.json"
                subprocess.run([PY, "-m", "kvserve.cli", "bench", "serve", "--base-url",
                                base_url, "--label", label, "--output-json", str(path),
                                "--no-progress", *SCENARIOS[scenario]], check=True, cwd=ROOT)
                summaries[scenario] = json.loads(path.read_text())["summary"]
        finally:
            stop_server(process)
    return summaries


def report(name: str, header: dict, sides: dict[str, dict], rounds: list[dict],
           scenarios: list[str]) -> str:
    machine = (f"CPU: {header['cpu_model_name']}, family {header['cpu_family']}, model "
               f"{header['cpu_model']}; kernel ISA level {header['isa_level']}; "
               f"{os.cpu_count()} cores.")
    checkouts = (f"before: `{sides['before']['commit']}` ({sides['before']['path']}); after: "
                 f"`{sides['after']['commit']}` ({sides['after']['path']}); rounds alternate "
                 "before, after.")
    knobs = {key: value for key, value in sorted(os.environ.items())
             if key.startswith("KVSERVE_")}
    settings = "KVSERVE_* settings: " + (", ".join(f"`{k}={v}`" for k, v in knobs.items())
                                         or "none (the defaults)")
    lines = [f"# {name}: before/after", "", machine, "", checkouts, "", settings, "",
             "| scenario | metric | before (per round) | after (per round) | before median | "
             "after median | after / before |", "|---|---|---|---|---|---|---|"]
    for scenario in scenarios:
        label, read, higher = METRICS[scenario]
        values = {side: [read(r[side][scenario]) for r in rounds] for side in ("before",
                                                                                "after")}
        medians = {side: statistics.median(v) for side, v in values.items()}
        ratio = medians["after"] / medians["before"]
        better = "higher is better" if higher else "lower is better"
        lines.append(f"| {scenario} | {label} ({better}) | "
                     f"{', '.join(f'{v:.2f}' for v in values['before'])} | "
                     f"{', '.join(f'{v:.2f}' for v in values['after'])} | "
                     f"{medians['before']:.2f} | {medians['after']:.2f} | {ratio:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from kvserve.bench.machine import cpu_slug, machine_header

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=ROOT)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scenarios", default="s1,s2")
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, default=8761)
    parser.add_argument("--server-args", default="",
                        help="flags both servers get, e.g. '--quantization w4a8' (one mode on "
                        "both sides)")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    header = machine_header()
    out_dir = RESULTS / cpu_slug(header) / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    sides = {side: {"path": str(path.resolve()), "commit": git_commit(path)}
             for side, path in (("before", args.before), ("after", args.after))}
    rounds = []
    for index in range(args.rounds):
        rounds.append({side: serve_and_measure(Path(sides[side]["path"]), args.port, scenarios,
                                               out_dir, f"{side}-r{index}",
                                               args.server_args.split())
                       for side in ("before", "after")})
        print(f"round {index} done", flush=True)
    (out_dir.parent / f"{args.name}.json").write_text(json.dumps(
        {"machine": header, "sides": sides, "rounds": rounds, "at": time.time()}, indent=1))
    text = report(args.name, header, sides, rounds, scenarios)
    if args.server_args:
        text += f"\nBoth servers ran with `{args.server_args}`.\n"
    (out_dir.parent / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
