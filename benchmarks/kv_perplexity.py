"""Perplexity of the quantized KV caches side by side: for each activation dtype (and chunk),
the held-out text scored over a KV cache in the activations' dtype, over int8 rows and over
fp8 (e4m3) rows, the same loaded model; written to benchmarks/results/<cpu>/<date>-<name>.md
(and .json).

Usage: .venv/bin/python benchmarks/kv_perplexity.py [--model M] [--max-windows N]
           [--modes float32,bfloat16,bfloat16:8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvserve.bench.perplexity import held_out_text, perplexity
from kvserve.kernels.reference import FP8_KV_DTYPE, kv_dtype_name
from kvserve.model_source import resolve_model
from kvserve.models.loader import load_model
from kvserve.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--modes", default="float32,bfloat16,bfloat16:8",
                        help="comma-separated activation dtype[:chunk] (chunk: tokens a step, "
                        "so the paged kernel reads the cache; none: each window in one step)")
    parser.add_argument("--name", default=None, help="the result files' name")
    args = parser.parse_args()
    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    tokens = tokenizer.encode(held_out_text(), add_special_tokens=False)
    # a window starts with BOS where the tokenizer adds one (Gemma; SmolLM2's adds none)
    adds_bos = len(tokenizer.encode("a")) > len(tokenizer.encode("a", add_special_tokens=False))
    bos = tokenizer.bos_token_id if adds_bos else None
    rows = []
    for mode in args.modes.split(","):
        dtype, _, chunk = mode.partition(":")
        model, _ = load_model(source, dtype, attention_backend="paged")
        for kv_dtype in (getattr(torch, dtype), torch.int8, FP8_KV_DTYPE):
            start = time.perf_counter()
            result = perplexity(model, tokens, max_windows=args.max_windows,
                                kv_dtype=kv_dtype, chunk=int(chunk) if chunk else None,
                                bos_token_id=bos)
            rows.append({"dtype": dtype, "kv_cache_dtype": kv_dtype_name(kv_dtype),
                         "chunk": int(chunk) if chunk else None, **result,
                         "seconds": time.perf_counter() - start})
            print(json.dumps(rows[-1]), flush=True)
        del model
    _write(rows, source.name, args.name or f"kv-perplexity-{source.name}")


def _write(rows: list[dict], model_name: str, name: str) -> None:
    from kvserve.bench.machine import cpu_label, machine_header
    from kvserve.bench.results import write_dated_result

    header = machine_header()
    lines = [f"# Perplexity by KV cache dtype ({model_name})", "",
             f"Held-out text (kvserve.bench.perplexity), {rows[0]['windows']} windows of "
             f"{rows[0]['window']} tokens, {rows[0]['tokens_scored']} predictions. torch "
             f"{torch.__version__}, CPU kernels on. CPU: {cpu_label(header)}.",
             "Chunk: tokens per step (the paged kernel reads the codes in place); - = each "
             "window in one prefill step (fresh windows: SDPA over the rows as stored, or with "
             "bf16 activations the flash kernel over a dequantized copy).", "",
             "| activations | chunk | KV | perplexity | vs the activations' dtype KV |",
             "|---|---|---|---|---|"]
    for row in rows:
        if row["kv_cache_dtype"] == row["dtype"]:
            base = row["perplexity"]
        delta = (row["perplexity"] / base - 1) * 100
        lines.append(f"| {row['dtype']} | {row['chunk'] or '-'} | {row['kv_cache_dtype']} | "
                     f"{row['perplexity']:.4f} | {delta:+.2f}% |")
    print(write_dated_result(RESULTS, header, name, rows, lines).read_text())


if __name__ == "__main__":
    main()
