"""kvserve with a busy neighbour: s1 and s2 while another process spins on one core, with the
thread governor on (the default) and off (--no-adaptive-threads), and the same idle for
reference. Writes benchmarks/results/<cpu-slug>/<name>.md beside <name>/ (the bench JSONs).

Usage: .venv/bin/python benchmarks/busy_neighbour.py [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import PY, RESULTS, SCENARIOS, wait_healthy  # noqa: E402

CASES = [("idle, governor on", [], False), ("neighbour, governor on", [], True),
         ("neighbour, --no-adaptive-threads", ["--no-adaptive-threads"], True)]


def run_case(label: str, flags: list[str], neighbour: bool, port: int, out_dir: Path) -> dict:
    server = subprocess.Popen([PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                               "--disable-log-requests", *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    spinner = None
    summary = {}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, 600)
        if neighbour:
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(3)  # the governor needs two one-second windows to agree
        for scenario in ("s1", "s2"):
            stem = label.replace(" ", "_").replace(",", "")
            path = out_dir / f"{stem}-{scenario}.json"
            subprocess.run([PY, "-m", "kvserve.cli", "bench", "serve", "--base-url",
                            f"http://127.0.0.1:{port}", "--no-progress", "--label", label,
                            "--output-json", str(path), *SCENARIOS[scenario]], check=True,
                           stdout=subprocess.DEVNULL)
            summary[scenario] = json.loads(path.read_text())["summary"]
    finally:
        for process in (spinner, server):
            if process is not None:
                process.kill()
                process.wait()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-busy-neighbour")
    parser.add_argument("--port", type=int, default=8300)
    args = parser.parse_args()
    header = machine_header()
    out_dir = RESULTS / cpu_slug(header) / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for offset, (label, flags, neighbour) in enumerate(CASES):
        summary = run_case(label, flags, neighbour, args.port + offset, out_dir)
        rows.append(f"| {label} | {summary['s1']['tpot_s']['p50'] * 1e3:.1f} | "
                    f"{summary['s2']['output_throughput']:.1f} | "
                    f"{summary['s2']['tpot_s']['p50'] * 1e3:.1f} |")
    text = (f"# kvserve with a busy neighbour, {args.name}\n\n"
            f"Machine: {cpu_label(header)}, {header['cores']} cores. The neighbour: "
            "`python -c 'while True: pass'` on one core, "
            "started 3 s before the client. Client: `kvserve bench serve`, scenarios s1 and s2 "
            "of benchmarks/run.py.\n\n"
            "| case | s1 TPOT p50 ms | s2 out tok/s | s2 TPOT p50 ms |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    (out_dir.parent / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
