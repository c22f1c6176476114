"""Start-up and memory beside llama.cpp, as a user who downloads a GGUF meets them: time from
launch to a 200 on /health, peak memory of the server's whole process tree while loading and
while serving, and how much the cache directory grows, for each GGUF given, kvserve and
llama-server on the same file with the same context length (llama-server's KV cache: f16, one
slot of --ctx tokens; kvserve's given the same bytes, --max-model-len --ctx). On an AMX CPU
llama-server runs with --no-repack (its AMX repacking crashes there; benchmarks/peers/
llamacpp.sh): the weights as the file maps them, its leanest memory.

Each system starts twice: the first kvserve start has a cache directory of its own (the
compiled kernels linked in, so only the model's first-start work counts: config and tokenizer
parsing, the autotuner's queue, packing the weights and, in the background, writing the
packed copy quant/pack_cache.py keeps, which the first start is left running to finish, as a
server left running would); the second reuses it (maps the packed copy). The file is in the
page cache for both systems (read once before timing), so neither pays the disk.

Memory is sampled every 50 ms: RSS summed over the process tree (what the issue quotes; it
counts shared library pages once per process) and PSS (shared pages divided among the processes
that map them: the tree's real share).

`--bundled` instead times `kvserve serve` on its default model with a quiet machine and beside
a process that keeps one core busy (first start: the autotune table empty; second: filled).

Usage: .venv/bin/python benchmarks/startup_memory.py MODEL.gguf [...] [--ctx 4096]
       .venv/bin/python benchmarks/startup_memory.py --bundled
Writes benchmarks/results/<cpu-slug>/<name>.md and <name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import psutil

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.paths import cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import PY, RESULTS, stop_server, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / "benchmarks/peers/work/llama.cpp/build/bin/llama-server"
PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 16
REQUESTS = 4
MAX_TOKENS = 32


class TreeMemory:
    """Peak RSS and PSS of a process and its descendants, sampled on a thread."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = pss = 0
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            for process in processes:
                try:
                    info = process.memory_full_info()
                    rss, pss = rss + info.rss, pss + info.pss
                except psutil.Error:
                    pass
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self._stop.wait(self.interval)

    def reset(self) -> None:
        self.peak_rss = self.peak_pss = 0

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"rss_mib": self.peak_rss / 2**20, "pss_mib": self.peak_pss / 2**20}


def gguf_shape(path: Path) -> dict:
    from kvserve.model_source import resolve_model
    from kvserve.weights import load_config

    config = load_config(resolve_model(path), use_cache=False)
    return {"layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "hidden": config.hidden_size}


def kv_bytes(shape: dict, ctx: int) -> int:
    """llama-server's f16 K and V for `ctx` tokens (kvserve's bf16 cache: the same bytes)."""
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2 * ctx


def serve(base_url: str) -> float:
    """REQUESTS concurrent completions of MAX_TOKENS tokens; seconds taken."""
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()

    def one():
        request = urllib.request.Request(base_url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()

    start = time.monotonic()
    threads = [threading.Thread(target=one) for _ in range(REQUESTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - start


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def run_once(command: list[str], env: dict, port: int, log: Path, serve_too: bool = True,
             before_stop: Callable[[], dict] | None = None) -> dict:
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    memory = TreeMemory(process.pid)
    record = {}
    try:
        base_url = f"http://127.0.0.1:{port}"
        record["healthy_s"] = wait_healthy(base_url, process, 900)
        record["load_peak"] = {"rss_mib": memory.peak_rss / 2**20,
                               "pss_mib": memory.peak_pss / 2**20}
        if serve_too:
            memory.reset()
            record["serve_s"] = serve(base_url)
            record["serving_peak"] = memory.stop()
        if before_stop is not None:
            record.update(before_stop())
    finally:
        memory.stop()
        stop_server(process)
    return record


def kvserve_command(model: str, port: int, extra: list[str]) -> list[str]:
    return [PY, "-m", "kvserve.cli", "serve", "--model", model, "--port", str(port),
            "--disable-log-requests", *extra]


def user_environment() -> dict:
    """This environment as a user's shell has it: Python writes its bytecode caches (some
    sandboxes set PYTHONDONTWRITEBYTECODE, which makes every start compile kvserve's modules
    again, ~0.2 s a process)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def fresh_cache() -> Path:
    """A cache directory of its own, the compiled kernels linked in from the usual one."""
    directory = Path(tempfile.mkdtemp(prefix="kvserve-cache-"))
    kernels = cache_dir() / "kernels"
    if kernels.exists():
        (directory / "kernels").symlink_to(kernels)
    return directory


def pack_cache_waiter(cache: Path, timeout_s: float = 900.0) -> Callable[[], dict]:
    """Keeps a first start running until its packed copy is written whole (the index file
    appears last, quant/pack_cache.py), as a server left running would, so that the second
    start maps a complete copy; records how long that took after serving."""
    def wait() -> dict:
        started = time.monotonic()
        while not any((cache / "gguf").glob("*.packed-*.json")):
            if time.monotonic() - started > timeout_s:
                return {"pack_cache_written_after_s": None}
            time.sleep(0.5)
        return {"pack_cache_written_after_s": round(time.monotonic() - started, 1)}
    return wait


def measure_model(path: Path, ctx: int, port: int, out_dir: Path) -> dict:
    shape = gguf_shape(path)
    kv = kv_bytes(shape, ctx)
    path.read_bytes()  # into the page cache: neither system pays the disk
    results = {"model": path.name, "file_mib": path.stat().st_size / 2**20, "ctx": ctx,
               "kv_mib": kv / 2**20}
    cache = fresh_cache()
    env = {**user_environment(), "KVSERVE_CACHE_DIR": str(cache)}
    flags = ["--max-model-len", str(ctx), "--kv-cache-memory-bytes", str(kv)]
    for start in ("first", "second"):
        before = directory_bytes(cache)
        record = run_once(kvserve_command(str(path), port, flags), env, port,
                          out_dir / f"{path.stem}-kvserve-{start}.log",
                          before_stop=pack_cache_waiter(cache) if start == "first" else None)
        record["cache_growth_mib"] = (directory_bytes(cache) - before) / 2**20
        results[f"kvserve_{start}"] = record
        print(path.name, "kvserve", start, record, flush=True)
    shutil.rmtree(cache)
    if LLAMA_SERVER.exists():
        command = [str(LLAMA_SERVER), "-m", str(path), "--host", "127.0.0.1", "--port",
                   str(port), "-c", str(ctx), "-np", "1", "-t", str(os.cpu_count())]
        if "amx_tile" in Path("/proc/cpuinfo").read_text():  # see peers/llamacpp.sh
            command.append("--no-repack")
        for start in ("first", "second"):
            record = run_once(command, user_environment(), port,
                              out_dir / f"{path.stem}-llamacpp-{start}.log")
            results[f"llamacpp_{start}"] = record
            print(path.name, "llama.cpp", start, record, flush=True)
    return results


def measure_bundled(port: int, out_dir: Path) -> dict:
    """The bundled model: first (empty autotune table) and second start, quiet and beside a
    busy core."""
    results = {}
    for neighbour in (False, True):
        cache = fresh_cache()
        env = {**user_environment(), "KVSERVE_CACHE_DIR": str(cache)}
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) \
            if neighbour else None
        try:
            for start in ("first", "second"):
                label = f"{'neighbour' if neighbour else 'quiet'}_{start}"
                record = run_once(kvserve_command("smollm2-135m-instruct", port, []), env, port,
                                  out_dir / f"bundled-{label}.log")
                results[label] = record
                print("bundled", label, record, flush=True)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
            shutil.rmtree(cache)
    return results


def _peak(record: dict, phase: str, kind: str) -> str:
    return f"{record[phase][kind]:.0f}" if phase in record else "-"


def model_rows(results: list[dict]) -> list[str]:
    rows = ["| model (file MiB, ctx) | system | start | healthy s | load peak RSS / PSS MiB | "
            "serving peak RSS / PSS MiB | cache growth MiB |", "|---|---|---|---|---|---|---|"]
    for result in results:
        for system in ("kvserve", "llamacpp"):
            for start in ("first", "second"):
                record = result.get(f"{system}_{start}")
                if record is None:
                    continue
                rows.append(
                    f"| {result['model']} ({result['file_mib']:.0f}, {result['ctx']}) | "
                    f"{system} | {start} | {record['healthy_s']:.1f} | "
                    f"{_peak(record, 'load_peak', 'rss_mib')} / "
                    f"{_peak(record, 'load_peak', 'pss_mib')} | "
                    f"{_peak(record, 'serving_peak', 'rss_mib')} / "
                    f"{_peak(record, 'serving_peak', 'pss_mib')} | "
                    f"{record.get('cache_growth_mib', 0):.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--bundled", action="store_true")
    parser.add_argument("--port", type=int, default=8410)
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    header = machine_header()
    name = args.name or time.strftime("%Y-%m-%d") + ("-startup-bundled" if args.bundled
                                                     else "-startup-memory")
    out_dir = RESULTS / cpu_slug(header) / name
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.bundled:
        results = measure_bundled(args.port, out_dir)
        rows = ["| case | healthy s | load peak RSS MiB |", "|---|---|---|"]
        rows += [f"| {label} | {r['healthy_s']:.1f} | {r['load_peak']['rss_mib']:.0f} |"
                 for label, r in results.items()]
    else:
        results = [measure_model(path, args.ctx, args.port, out_dir) for path in args.models]
        rows = model_rows(results)
    (out_dir.parent / f"{name}.json").write_text(json.dumps(
        {"machine": header, "results": results}, indent=1))
    text = (f"# Start-up and memory, {name}\n\nMachine: {cpu_label(header)}, "
            f"{header['cores']} cores. Command: `.venv/bin/python benchmarks/startup_memory.py "
            f"{' '.join(sys.argv[1:])}`. Serving: {REQUESTS} concurrent completions of "
            f"{MAX_TOKENS} tokens.\n\n" + "\n".join(rows) + "\n")
    (out_dir.parent / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
