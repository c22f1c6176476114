"""What does one tensor-parallel collective cost on this host: gloo or shared memory?

A TP rank of SmolLM2 all-reduces a [rows, 576] hidden state twice per layer (after o_proj and
down_proj: 60 calls per step over 30 layers, plus one after the embedding) and gathers one
[rows, 49152 / tp] logits shard per step. This times both collectives through the two
communicators (kvserve/distributed: gloo's via torch.distributed, and the shared-memory one) at
batch 1 and 32 rows, float32 and bfloat16, world sizes 2 and 3, ranks in spawned processes with
one thread each (kvserve/testing/rank_pool.py). Reported: the median per-call time over
back-to-back calls (each rank's median; the slowest rank's), after a warm-up.

Usage: .venv/bin/python benchmarks/allreduce.py [--calls 2000] [--world-sizes 2 3] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.testing.rank_pool import RankPool

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN = 576
VOCAB = 49152
CASES = [("all-reduce", rows, dtype) for dtype in ("float32", "bfloat16") for rows in (1, 32)] \
    + [("logits gather", rows, "float32") for rows in (1, 32)]


def time_collective(contexts, communicator_name: str, kind: str, rows: int, dtype_name: str,
                    calls: int) -> float:
    """On every rank: the median microseconds per call of one collective, back to back."""
    parallel = contexts[communicator_name]
    communicator = parallel.communicator
    dtype = getattr(torch, dtype_name)
    if kind == "all-reduce":
        tensor = torch.randn(rows, HIDDEN).to(dtype)
        call = communicator.all_reduce_
    else:
        tensor = torch.randn(rows, -(-VOCAB // parallel.tp_size)).to(dtype)
        call = communicator.all_gather_last_dim
    times = []
    for _ in range(calls // 10 + calls):
        start = time.perf_counter()
        call(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times[calls // 10:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-allreduce")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    header = machine_header()
    load_before = os.getloadavg()[0]
    rows_md, records = [], []
    for world_size in args.world_sizes:
        with RankPool(world_size) as pool:
            for kind, rows, dtype in CASES:
                micros = {}
                for name in ("torch", "shm"):
                    micros[name] = max(pool.run(time_collective, name, kind, rows, dtype,
                                                args.calls))
                    records.append({"world_size": world_size, "collective": kind, "rows": rows,
                                    "dtype": dtype, "communicator": name,
                                    "us_per_call_p50": micros[name]})
                rows_md.append(f"| {world_size} | {kind} | {rows} | {dtype} | "
                               f"{micros['torch']:.1f} | {micros['shm']:.1f} | "
                               f"{micros['torch'] / micros['shm']:.1f}x |")
    out_dir = RESULTS / cpu_slug(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = (f"# Tensor-parallel collectives, gloo vs shared memory, {args.name}\n\n"
            f"Machine: {cpu_label(header)}, {header['cores']} cores. `benchmarks/allreduce.py`: "
            f"ranks in spawned processes (one thread each), {args.calls} back-to-back calls per "
            f"case after {args.calls // 10} warm-up calls; median microseconds per call (the "
            f"slowest rank's). All-reduce: [rows, {HIDDEN}] (SmolLM2's hidden state, 61 calls "
            f"per step); logits gather: [rows, {VOCAB} / tp] per rank (one call per step). "
            f"Load average (1 min) before / after: {load_before:.1f} / "
            f"{os.getloadavg()[0]:.1f}.\n\n"
            "| ranks | collective | rows | dtype | gloo us | shm us | gloo / shm |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows_md) + "\n")
    (out_dir / f"{args.name}.md").write_text(text)
    (out_dir / f"{args.name}.json").write_text(json.dumps(
        {"machine": header, "load_average": [load_before, os.getloadavg()[0]],
         "results": records}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
