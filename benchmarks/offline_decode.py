"""Offline single-stream decode and prefill, kvserve against llama.cpp's own `llama-bench`,
interleaved.

The issue's offline row is `llama-bench -n 128` (tg128) against our batch-1 decode step. On
these VMs one process's speed drifts by 20% from minute to minute, so the two systems take turns:
each round runs one llama-bench repetition (`-r 1`) then one kvserve request, for every context
depth, and the report gives the medians of the rounds and the ratio of the medians.

Depth d means what llama-bench's `-d` means: d tokens already in the context, then 128 tokens
generated and timed (s1 is a 256-token prompt and 128 outputs: depth 256). kvserve side: one
offline engine (`LLM`, core on a thread), a request with a d-token prompt (one token at depth 0),
prefilled untimed, then 128 decode steps timed; ms a token is their mean, like llama-bench's.

Prefill p (`--prefill 512`) is llama-bench's pp512 (`-p 512 -n 0`): one p-token prompt of random
ids, timed from add_request until its first token (kvserve prefills it in one step when p is
within max_num_batched_tokens); the rate is tokens a second.

Usage: .venv/bin/python benchmarks/offline_decode.py [--rounds 7] [--depths 0,256] [--name N]
       [--model gemma3-270m] [--prefill 512]
Writes benchmarks/results/<cpu>/<date>-<name>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# KVSERVE_CPU_ISA=avx2 (an AVX-512 machine standing in for an AVX2-only one): llama.cpp's AVX2
# build beside our AVX2 kernels, as benchmarks/peers/llamacpp.sh builds and serves it
_BUILD = "build-avx2" if os.environ.get("KVSERVE_CPU_ISA") == "avx2" else "build"
LLAMA_BENCH = ROOT / f"benchmarks/peers/work/llama.cpp/{_BUILD}/bin/llama-bench"
NEW_TOKENS = 128


def llama_bench_ms(model_path: str, depth: int, threads: int) -> float:
    """One tg128 repetition at this depth: ms a token (llama-bench's avg_ns / 128)."""
    command = [str(LLAMA_BENCH), "-m", model_path, "-p", "0", "-n", str(NEW_TOKENS),
               "-d", str(depth), "-t", str(threads), "-r", "1", "-o", "json"]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    (test,) = json.loads(result.stdout)
    return test["avg_ns"] / 1e6 / NEW_TOKENS


def llama_bench_prefill_ms(model_path: str, prompt: int, threads: int) -> float:
    """One pp repetition: ms for the whole prompt."""
    command = [str(LLAMA_BENCH), "-m", model_path, "-p", str(prompt), "-n", "0",
               "-t", str(threads), "-r", "1", "-o", "json"]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    (test,) = json.loads(result.stdout)
    return test["avg_ns"] / 1e6


def kvserve_prefill_ms(engine, prompt_len: int, round_index: int) -> float:
    """A fresh prompt of random ids (no prefix hits), timed until its first token: ms."""
    from kvserve import SamplingParams

    rng = random.Random(7919 * prompt_len + round_index)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    request_id = f"p{prompt_len}-r{round_index}"
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while not any(o.request_id == request_id and o.finished for o in engine.step()):
        pass
    return (time.perf_counter() - start) * 1000


def kvserve_ms(engine, depth: int, round_index: int) -> float:
    """A fresh request of `depth` prompt tokens (random ids, no prefix hits between rounds),
    prefilled untimed, then NEW_TOKENS decode steps: mean ms a step."""
    from kvserve import SamplingParams

    rng = random.Random(1000 * depth + round_index)
    prompt = [rng.randrange(100, 40000) for _ in range(max(depth, 1))]
    request_id = f"d{depth}-r{round_index}"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS + 1, ignore_eos=True)
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    generated = 0
    while generated == 0:  # prefill (and its first token), untimed
        generated = sum(len(o.outputs[0].token_ids) for o in engine.step()
                        if o.request_id == request_id)
    start = time.perf_counter()
    for _ in range(NEW_TOKENS):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_request([request_id])
    return elapsed * 1000 / NEW_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--depths", default="0,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", default="", help="prompt lengths whose prefill is timed "
                        "against llama-bench's pp (e.g. 512); none by default")
    parser.add_argument("--name", default="offline-decode")
    parser.add_argument("--model", default=None, help="a short name or path (default: the "
                        "bundled SmolLM2); llama-bench reads the same GGUF")
    args = parser.parse_args()
    _refuse_to_overwrite(args.name)
    depths = [int(d) for d in args.depths.split(",") if d]
    prefills = [int(p) for p in args.prefill.split(",") if p]

    # the rounds alternate with llama-bench by design: the thread governor would read its turn
    # as a busy neighbour and drop our kernels to one thread for the next round
    os.environ.setdefault("KVSERVE_ADAPTIVE_THREADS", "0")
    from kvserve import LLM
    from kvserve.bench.machine import cpu_label, cpu_slug, machine_header

    llm = LLM(engine_core="thread", **({"model": args.model} if args.model else {}))
    engine = llm.llm_engine
    model_path = str(engine.source.path)  # llama-bench reads the same GGUF
    for depth in depths[:1]:
        kvserve_ms(engine, depth, -1)  # warm-up
    for prompt_len in prefills[:1]:
        kvserve_prefill_ms(engine, prompt_len, -1)
    rounds: dict[str, dict[int, list[float]]] = {"kvserve": {}, "llama.cpp": {}}
    prefill_rounds: dict[str, dict[int, list[float]]] = {"kvserve": {}, "llama.cpp": {}}
    for round_index in range(args.rounds):
        for prompt_len in prefills:
            prefill_rounds["llama.cpp"].setdefault(prompt_len, []).append(
                llama_bench_prefill_ms(model_path, prompt_len, args.threads))
            prefill_rounds["kvserve"].setdefault(prompt_len, []).append(
                kvserve_prefill_ms(engine, prompt_len, round_index))
            print(f"round {round_index} prefill {prompt_len}: llama.cpp "
                  f"{prefill_rounds['llama.cpp'][prompt_len][-1]:.1f} ms, kvserve "
                  f"{prefill_rounds['kvserve'][prompt_len][-1]:.1f} ms", flush=True)
        for depth in depths:
            rounds["llama.cpp"].setdefault(depth, []).append(
                llama_bench_ms(model_path, depth, args.threads))
            rounds["kvserve"].setdefault(depth, []).append(kvserve_ms(engine, depth, round_index))
            print(f"round {round_index} depth {depth}: llama.cpp "
                  f"{rounds['llama.cpp'][depth][-1]:.2f} ms, kvserve "
                  f"{rounds['kvserve'][depth][-1]:.2f} ms", flush=True)
    header = machine_header()
    report = {"name": args.name, "date": datetime.date.today().isoformat(), "machine": header,
              "cpu": cpu_label(header), "model": model_path, "new_tokens": NEW_TOKENS,
              "threads": args.threads, "round_count": args.rounds, "rounds": rounds,
              "summary": _summary(rounds, depths),
              "llama_bench": str(LLAMA_BENCH.relative_to(ROOT)),
              "autotune": os.environ.get("KVSERVE_AUTOTUNE", "1"),
              "prefill_rounds": prefill_rounds, "prefill_summary": _summary(prefill_rounds,
                                                                            prefills)}
    out = ROOT / "benchmarks/results" / cpu_slug(header) / f"{report['date']}-{args.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(_markdown(report, depths, prefills))
    print(out.with_suffix(".md").read_text())


def _refuse_to_overwrite(name: str) -> None:
    """Exit before measuring if today's <date>-<name> results exist: run.py's reports live in
    the same folder (`--name <date>-<name>` there is this file's name here), and a clash would
    silently replace one tool's results with the other's."""
    from kvserve.bench.machine import cpu_slug, machine_header

    out = (ROOT / "benchmarks/results" / cpu_slug(machine_header())
           / f"{datetime.date.today().isoformat()}-{name}")
    clashes = [str(path.relative_to(ROOT)) for path in
               (out.with_suffix(".md"), out.with_suffix(".json"), out) if path.exists()]
    if clashes:
        sys.exit(f"offline_decode: {', '.join(clashes)} already exist(s); pick another --name")


def _summary(rounds: dict, depths: list[int]) -> dict:
    summary = {}
    for depth in depths:
        ours = statistics.median(rounds["kvserve"][depth])
        theirs = statistics.median(rounds["llama.cpp"][depth])
        # adjacent runs share the VM's mood of the moment: their ratio is the steadier figure
        paired = statistics.median(a / b for a, b in zip(rounds["kvserve"][depth],
                                                         rounds["llama.cpp"][depth]))
        summary[depth] = {"kvserve_ms": ours, "llama_cpp_ms": theirs, "ratio": ours / theirs,
                          "median_round_ratio": paired}
    return summary


def _markdown(report: dict, depths: list[int], prefills: list[int]) -> str:
    lines = [f"# {report['name']} ({report['date']})", "",
             f"CPU: {report['cpu']}. Model: {report['model']}. {report['threads']} threads, "
             f"{report['round_count']} interleaved rounds against kvserve's offline engine "
             f"(benchmarks/offline_decode.py); llama.cpp: {report.get('llama_bench', '-')}; "
             f"KVSERVE_AUTOTUNE={report.get('autotune', '1')}."]
    if depths:
        lines += ["", f"Decode (tg{NEW_TOKENS} at each depth: `llama-bench -p 0 -n {NEW_TOKENS} "
                  "-d D -r 1`):", "",
                  "| depth | kvserve ms/token (median) | llama.cpp ms/token (median) | ratio | "
                  "median of the rounds' ratios | kvserve rounds | llama.cpp rounds |",
                  "|---|---|---|---|---|---|---|"]
    for depth in depths:
        row = report["summary"][depth]
        ours = ", ".join(f"{v:.2f}" for v in report["rounds"]["kvserve"][depth])
        theirs = ", ".join(f"{v:.2f}" for v in report["rounds"]["llama.cpp"][depth])
        lines.append(f"| {depth} | {row['kvserve_ms']:.2f} | {row['llama_cpp_ms']:.2f} | "
                     f"{row['ratio']:.2f}x | {row['median_round_ratio']:.2f}x | {ours} | "
                     f"{theirs} |")
    if prefills:
        lines += ["", "Prefill (`llama-bench -p P -n 0 -r 1` against one P-token prompt timed to "
                  "its first token):", "",
                  "| prompt | kvserve ms (median) | llama.cpp ms (median) | kvserve tok/s | "
                  "llama.cpp tok/s | ratio | median of the rounds' ratios |",
                  "|---|---|---|---|---|---|---|"]
        for prompt_len in prefills:
            row = report["prefill_summary"][prompt_len]
            lines.append(f"| {prompt_len} | {row['kvserve_ms']:.1f} | {row['llama_cpp_ms']:.1f} | "
                         f"{1000 * prompt_len / row['kvserve_ms']:.0f} | "
                         f"{1000 * prompt_len / row['llama_cpp_ms']:.0f} | {row['ratio']:.2f}x | "
                         f"{row['median_round_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
