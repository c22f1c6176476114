"""Time the GGUF kernels (gguf_linear_q8 per type; Q4_1 is int4_linear_q8 on its own panels, the
baseline) at one instruction-set level: weight GB/s at one row, time per call at 8 and 64 rows,
for (N x K) = 2048 x 2048, 8192 x 2048 and 2048 x 8192, and each time against Q4_1's per weight.
Weights stream from DRAM: each timed call reads the next of enough copies to exceed
--stream-mb (more than this CPU's L3); the median of --calls calls. Also gguf_pack's throughput
over a tensor's file bytes. Each line says how many cores' worth of CPU other processes took
while it was measured (/proc/stat): on a shared machine, figures taken beside a busy neighbour
are not comparable (a 2-thread call waits whole time slices for a preempted thread).

Usage: .venv/bin/python benchmarks/gguf_kernels.py [--level avx2] [--threads 1] [--qtypes ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvserve.kernels import cpu_load, get_ops, isa, reference

SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))
QTYPES = ("Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q4_0", "Q8_0")
ROWS = (1, 8, 64)
# byte offsets of the float16 scales in each file block (the rest of a block: random bytes)
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def file_rows(qtype: str, rows: int, cols: int) -> torch.Tensor:
    """Random file blocks with normal float16 scales (no denormals: they would slow the float
    steps, which real files do not)."""
    values, size, _ = reference.GGUF_FORMATS[qtype]
    generator = np.random.default_rng(0)
    blocks = generator.integers(0, 256, (rows, cols // values, size), np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scale = generator.uniform(1e-3, 1e-2, (rows, cols // values)).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def median_us(call, copies: int, calls: int) -> float:
    """The median of `calls` timed calls, call(i) reading copy i % copies."""
    for i in range(min(copies, 8)):
        call(i)
    times = []
    for i in range(calls):
        start = time.perf_counter()
        call(i % copies)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def measure(ops, qtype: str, n: int, k: int, args) -> dict[int, float]:
    """us per call at each row count for one type and shape."""
    panels = ops.gguf_pack(file_rows(qtype, n, k), qtype)
    copies = [panels] + [panels.clone() for _ in range(args.stream_mb * 2 ** 20 // panels.numel())]
    times = {}
    for rows in ROWS:
        x = torch.randn(rows, k)
        calls = args.calls if rows < 64 else args.calls // 4
        times[rows] = median_us(lambda i: ops.gguf_linear_q8(x, copies[i], qtype, None, n),
                                len(copies), calls)
    times["bytes"] = panels.numel()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--level", default=None)
    parser.add_argument("--qtypes", default=",".join(QTYPES))
    parser.add_argument("--stream-mb", type=int, default=640)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = get_ops(True, args.level)
    cpu = isa.cpu_description()
    print(f"{cpu['model_name']} (family {cpu['family']}, model {cpu['model']}), level {ops.isa}, "
          f"{args.threads} threads, x float32; 1 row: GB/s of weights, 8 and 64 rows: us per "
          "call; (x Q4_1): against int4_linear_q8 on Q4_1, GB/s at 1 row, time per weight at 8 "
          "and 64")
    print(f"{'qtype':6} {'N x K':>11} {'bits/w':>6} {'1 row GB/s':>16} {'8 rows us':>16} "
          f"{'64 rows us':>17} {'neighbour':>9}")
    baseline = {}
    for qtype in args.qtypes.split(","):
        for n, k in SHAPES:
            before = cpu_load.read_cpu_sample()
            times = measure(ops, qtype, n, k, args)
            after = cpu_load.read_cpu_sample()
            busy = (cpu_load.neighbour_cores(before, after, cpu_load.ticks_per_second())
                    if before and after else float("nan"))
            if qtype == "Q4_1":
                baseline[n, k] = times
            ref = baseline.get((n, k))
            ratio = {rows: (f"({times[rows] / ref[rows]:.2f}x)" if ref else "") for rows in ROWS}
            if ref:  # at one row: GB/s against Q4_1's
                ratio[1] = f"({times['bytes'] * ref[1] / (ref['bytes'] * times[1]):.2f}x)"
            print(f"{qtype:6} {n:5d}x{k:<5d} {times['bytes'] * 8 / (n * k):6.3f} "
                  f"{times['bytes'] / times[1] / 1e3:8.2f} {ratio[1]:>7} "
                  f"{times[8]:8.1f} {ratio[8]:>7} {times[64]:9.1f} {ratio[64]:>7} {busy:9.2f}")
        raw = file_rows(qtype, 8192, 2048)
        pack_us = median_us(lambda i: ops.gguf_pack(raw, qtype), 1, 20)
        print(f"{qtype:6} gguf_pack 8192x2048: {raw.numel() / pack_us / 1e3:.2f} GB/s of file "
              "bytes")


if __name__ == "__main__":
    main()
