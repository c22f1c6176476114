"""Time the GGUF kernels (gguf_linear_q8 per type; Q4_1 is int4_linear_q8 on its own panels, the
baseline) at one instruction-set level: weight GB/s at one row, time per call at 8 and 64 rows,
for (N x K) = 2048 x 2048, 8192 x 2048 and 2048 x 8192, and each time against Q4_1's per weight.
Weights stream from DRAM: each timed call reads the next of enough copies to exceed
--stream-mb (more than this CPU's L3); the median of --calls calls (a quarter at 64 rows), the
types interleaved in --rounds rounds. Also gguf_pack's throughput over a tensor's file bytes,
and gguf_linear_dequant beside at::linear (--dequant), and the per-32 integer kernel against the
super-block one at 8-512 rows (--superblocks). Each shape's lines say how many cores'
worth of CPU other processes took while it was measured (/proc/stat): on a shared machine,
figures taken beside a busy neighbour are not comparable (a 2-thread call waits whole time
slices for a preempted thread).

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


def timed_us(call, copies: int, calls: int, start: int = 0) -> list[float]:
    """`calls` timed calls (us), call(i) reading copy i % copies from copy `start` on."""
    times = []
    for i in range(start, start + calls):
        begin = time.perf_counter()
        call(i % copies)
        times.append((time.perf_counter() - begin) * 1e6)
    return times


def measure(ops, qtypes: list[str], n: int, k: int, args) -> dict[str, dict]:
    """us per call (medians) at each row count for every type at one shape, the types
    interleaved round by round, so drift and a neighbour's bursts hit them alike."""
    copies, samples = {}, {}
    for qtype in qtypes:
        panels = ops.gguf_pack(file_rows(qtype, n, k), qtype)
        extra = args.stream_mb * 2 ** 20 // panels.numel()
        copies[qtype] = [panels] + [panels.clone() for _ in range(extra)]
        samples[qtype] = {rows: [] for rows in ROWS}
    xs = {rows: torch.randn(rows, k) for rows in ROWS}
    for round_ in range(args.rounds):
        for qtype in qtypes:
            streams = copies[qtype]
            for rows in ROWS:
                x = xs[rows]
                calls = max(1, args.calls // args.rounds // (4 if rows == 64 else 1))
                call = lambda i: ops.gguf_linear_q8(x, streams[i], qtype, None, n)  # noqa: E731
                timed_us(call, len(streams), 2, start=round_ * calls)  # warm the next copies
                samples[qtype][rows] += timed_us(call, len(streams), calls,
                                                 start=round_ * calls + 2)
    return {qtype: {"bytes": copies[qtype][0].numel(),
                    **{rows: float(np.median(samples[qtype][rows])) for rows in ROWS}}
            for qtype in qtypes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--level", default=None)
    parser.add_argument("--qtypes", default=",".join(QTYPES))
    parser.add_argument("--stream-mb", type=int, default=640)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dequant", default="Q4_K,Q6_K",
                        help="types to time gguf_dequantize and gguf_linear_dequant for")
    parser.add_argument("--superblocks", default="Q4_K,Q6_K",
                        help="K-quant types to time gguf_linear_q8 against gguf_linear_q8k for")
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
          f"{'64 rows us':>17} {'neighbour':>9}")  # neighbour: over the shape's whole run
    qtypes = args.qtypes.split(",")
    for n, k in SHAPES:
        before = cpu_load.read_cpu_sample()
        results = measure(ops, qtypes, n, k, args)
        after = cpu_load.read_cpu_sample()
        busy = (cpu_load.neighbour_cores(before, after, cpu_load.ticks_per_second())
                if before and after else float("nan"))
        ref = results.get("Q4_1")
        for qtype, times in results.items():
            ratio = {rows: (f"({times[rows] / ref[rows]:.2f}x)" if ref else "") for rows in ROWS}
            if ref:  # at one row: GB/s against Q4_1's
                ratio[1] = f"({times['bytes'] * ref[1] / (ref['bytes'] * times[1]):.2f}x)"
            print(f"{qtype:6} {n:5d}x{k:<5d} {times['bytes'] * 8 / (n * k):6.3f} "
                  f"{times['bytes'] / times[1] / 1e3:8.2f} {ratio[1]:>7} "
                  f"{times[8]:8.1f} {ratio[8]:>7} {times[64]:9.1f} {ratio[64]:>7} {busy:9.2f}")
    for qtype in qtypes:
        raw = file_rows(qtype, 8192, 2048)
        pack_us = float(np.median(timed_us(lambda i: ops.gguf_pack(raw, qtype), 1, 20)))
        print(f"{qtype:6} gguf_pack 8192x2048: {raw.numel() / pack_us / 1e3:.2f} GB/s of file "
              "bytes")
    for qtype in args.dequant.split(",") if args.dequant else ():
        dequant_lines(ops, qtype)
    for qtype in args.superblocks.split(",") if args.superblocks else ():
        superblock_lines(ops, qtype)


def superblock_lines(ops, qtype: str, rows_list=(8, 64, 512)) -> None:
    """gguf_linear_q8 (x per group of 32) against gguf_linear_q8k (per super-block of 256, what
    K-quant calls of 8+ rows take) in G multiply-adds a second, the weights in cache (the
    kernels' compute rate, where prefill runs), calls alternating, the best of 5 batches."""
    for n, k in SHAPES:
        panels = ops.gguf_pack(file_rows(qtype, n, k), qtype)
        line = [f"{qtype:6} {n}x{k} G MAC/s q8 / q8k:"]
        for rows in rows_list:
            x = torch.randn(rows, k)
            repeats = max(3, int(2e8 / (rows * n * k)))
            best = {}
            for _ in range(5):
                for name in ("gguf_linear_q8", "gguf_linear_q8k"):
                    kernel = getattr(ops, name)
                    begin = time.perf_counter()
                    for _ in range(repeats):
                        kernel(x, panels, qtype, None, n)
                    seconds = (time.perf_counter() - begin) / repeats
                    best[name] = min(best.get(name, seconds), seconds)
            line.append(f"{rows} rows {rows * n * k / best['gguf_linear_q8'] / 1e9:.0f} / "
                        f"{rows * n * k / best['gguf_linear_q8k'] / 1e9:.0f}")
        print(", ".join(line))


def dequant_lines(ops, qtype: str, n: int = 8192, k: int = 2048) -> None:
    """gguf_linear_dequant against at::linear of the same weights already dense in x's dtype
    (what it saves: the dense copy's memory), calls alternating; and gguf_dequantize's rate."""
    panels = ops.gguf_pack(file_rows(qtype, n, k), qtype)
    for dtype in (torch.float32, torch.bfloat16):
        dense = ops.gguf_dequantize(panels, qtype, range(n), k, dtype)
        rows_us = float(np.median(timed_us(
            lambda i: ops.gguf_dequantize(panels, qtype, range(512 * i, 512 * i + 512), k,
                                          dtype), 16, 64)))
        line = [f"{qtype:6} {dtype} {n}x{k}: dequantize {512 * k / rows_us / 1e3:.2f} G values/s"]
        for rows in (64, 256):
            x = torch.randn(rows, k).to(dtype)
            ours, theirs = [], []
            for _ in range(10):
                ours += timed_us(lambda i: ops.gguf_linear_dequant(x, panels, qtype, None, n), 1, 1)
                theirs += timed_us(lambda i: torch.nn.functional.linear(x, dense), 1, 1)
            line.append(f"{rows} rows {np.median(ours) / 1e3:.2f} ms (dense "
                        f"{np.median(theirs) / 1e3:.2f})")
        print(", ".join(line))


if __name__ == "__main__":
    main()
