"""Decode attention per layer call with a bf16 and an int8 KV cache: SmolLM2-135M's heads (9
query, 3 KV, head size 64), a batch of one-token queries over each of `--contexts` cached tokens, the
layers' caches cycled so each call reads its K/V from DRAM as a real decode step does (30 layers
of 32 x 512 tokens in bf16 are ~240 MB). Every ISA level this CPU can execute, with the
activations of each level's default (bf16 on AVX512-BF16, float32 elsewhere) unless --dtype.

Usage: .venv/bin/python benchmarks/kv_attention.py [--batch 32] [--contexts 256,512,1024]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvserve.attention import build_attention_metadata
from kvserve.bench.machine import machine_header
from kvserve.kernels import get_ops, isa, reference

HEADS, KV_HEADS, DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def time_level(level: str, act: torch.dtype, batch: int, context: int,
               repeats: int = 15) -> dict[str, float]:
    """Median microseconds per layer call for a bf16 and an int8 cache, the two timed in turn
    within each repeat (this VM's speed drifts by +-30% between runs; interleaving keeps the
    ratio honest)."""
    ops = get_ops(True, level)
    blocks = batch * -(-context // BLOCK)
    tables = torch.randperm(blocks).view(batch, -1).tolist()  # scattered, as a real pool's
    metadata, _ = build_attention_metadata([1] * batch, [context] * batch, tables, BLOCK)
    torch.manual_seed(0)
    values = [torch.randn(2, blocks, BLOCK, KV_HEADS, DIM) for _ in range(LAYERS)]
    caches = {str(kv).removeprefix("torch."): [reference.to_cache_rows(v, kv) for v in values]
              for kv in (torch.bfloat16, torch.int8)}
    del values
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, dtype=act)
    out = torch.empty(batch, HEADS * DIM, dtype=act)
    args = (torch.arange(batch, dtype=torch.int32), metadata.query_start_loc.long(),
            metadata.seq_lens, metadata.block_tables, HEADS, KV_HEADS, DIM, DIM**-0.5, 0)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(repeats):
        for name, layers in caches.items():
            start = time.perf_counter()
            for cache in layers:
                ops.paged_attention_(qkv, cache, out, *args)
            times[name].append((time.perf_counter() - start) / LAYERS * 1e6)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="256,512,1024")
    parser.add_argument("--dtype", choices=["default", "float32", "bfloat16"], default="default")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for level in isa.machine_levels():
        if level == "scalar":
            continue
        act = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            args.dtype, torch.bfloat16 if level == "avx512_bf16" else torch.float32)
        for context in (int(c) for c in args.contexts.split(",")):
            times = time_level(level, act, args.batch, context)
            rows.append({"level": level, "activations": str(act).removeprefix("torch."),
                         "context": context, **times})
            print(f"{level:12s} {rows[-1]['activations']:9s} context {context:5d}  "
                  f"bf16 KV {times['bfloat16']:7.1f} us  int8 KV {times['int8']:7.1f} us  "
                  f"({times['bfloat16'] / times['int8']:.2f}x)", flush=True)
    result = {"machine": machine_header(), "batch": args.batch,
              "us_per_layer_call": rows}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
