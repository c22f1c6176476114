"""Time our low-bit kernels against the dense GEMM of the same weights at SmolLM2's projection
shapes and a range of row counts, at one instruction-set level, weights streamed from DRAM (each
timed call reads another of enough copies to exceed the L3). This is what the autotuner decides
from at start-up; run it by hand to see the whole table.

Usage: .venv/bin/python benchmarks/kernel_crossover.py [--level avx2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvserve.kernels import get_ops, reference

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
STREAM_BYTES = 96 << 20


def _copies(nbytes: int) -> int:
    return max(2, -(-STREAM_BYTES // max(1, nbytes)))


def _median_us(fn, copies: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(copies):
            fn(i)
        times.append((time.perf_counter() - start) / copies)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--level", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    ops = get_ops(True, args.level)
    dtype = getattr(torch, args.dtype)
    print(f"level {ops.isa}, x {args.dtype}, {torch.get_num_threads()} threads; us per call")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k) * 0.05
        if name == "lm_head":
            packed = reference.pack_int8(*reference.quantize_int8_groupwise(weight))
            low_bit = [packed.clone() for _ in range(_copies(packed.numel()))]
            kernel = ops.int8_linear
        else:
            from kvserve.quant.linear import quantize_int4_groupwise
            codes, scale, low = quantize_int4_groupwise(weight)
            packed = reference.pack_int4(codes, scale, low + 8 * scale,
                                         torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
            low_bit = [packed.clone() for _ in range(_copies(packed.numel()))]
            kernel = ops.int4_linear
        dense = [weight.to(dtype) for _ in range(_copies(weight.numel() * weight.element_size()))]
        print(f"{name} [{n} x {k}]")
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            ours = _median_us(lambda i: kernel(x, low_bit[i], None, n), len(low_bit))
            theirs = _median_us(lambda i: F.linear(x, dense[i]), len(dense))
            print(f"  rows {rows:4d}: ours {ours:9.1f}  dense {theirs:9.1f}  "
                  f"{'ours' if ours < theirs else 'dense'}")


if __name__ == "__main__":
    main()
