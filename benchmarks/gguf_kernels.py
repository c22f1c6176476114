"""Time the GGUF kernels (gguf_linear_q8 per type, int4_linear_q8 on Q4_1 panels as the baseline)
at one instruction-set level: weight GB/s at one row, time per call at 8 and 64 rows, for
(N x K) = 2048 x 2048, 8192 x 2048 and 2048 x 8192. Weights stream from DRAM: each timed call
reads the next of enough copies to exceed --stream-mb (more than this CPU's L3); the median of
--calls calls. Also gguf_pack's throughput over a tensor's file bytes.

Usage: .venv/bin/python benchmarks/gguf_kernels.py [--level avx2] [--qtypes Q4_K,Q6_K]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvserve.kernels import get_ops, isa, reference

SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))
QTYPES = ("Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q4_0", "Q8_0")
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
        scale = (generator.uniform(1e-3, 1e-2, (rows, cols // values))).astype(np.float16)
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
          f"{torch.get_num_threads()} threads, x float32; 1 row: GB/s of weights, 8 and 64 "
          "rows: us per call")
    print(f"{'qtype':6} {'N x K':>11} {'bits/w':>6} {'1 row GB/s':>10} {'1 row us':>9} "
          f"{'8 rows us':>9} {'64 rows us':>10}")
    for qtype in args.qtypes.split(","):
        for n, k in SHAPES:
            panels = ops.gguf_pack(file_rows(qtype, n, k), qtype)
            copies = [panels] + [panels.clone()
                                 for _ in range(args.stream_mb * 2 ** 20 // panels.numel())]
            times = {}
            for rows in (1, 8, 64):
                x = torch.randn(rows, k)
                calls = args.calls if rows < 64 else args.calls // 4
                times[rows] = median_us(
                    lambda i: ops.gguf_linear_q8(x, copies[i], qtype, None, n), len(copies),
                    calls)
            print(f"{qtype:6} {n:5d}x{k:<5d} {panels.numel() * 8 / (n * k):6.3f} "
                  f"{panels.numel() / times[1] / 1e3:10.2f} {times[1]:9.1f} {times[8]:9.1f} "
                  f"{times[64]:10.1f}")
            del copies
        raw = file_rows(qtype, 8192, 2048)
        pack_us = median_us(lambda i: ops.gguf_pack(raw, qtype), 1, 20)
        print(f"{qtype:6} gguf_pack 8192x2048: {raw.numel() / pack_us / 1e3:.2f} GB/s of file "
              "bytes")


if __name__ == "__main__":
    main()
