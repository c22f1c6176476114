"""Perplexity of every precision/quantization mode on the held-out stdlib documentation, side by
side, written to benchmarks/results/<date>-perplexity.md (and .json). Picks defaults from data.

Usage: .venv/bin/python benchmarks/perplexity.py [--max-windows N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvserve.bench.perplexity import HELD_OUT_MODULES, held_out_text, perplexity
from kvserve.model_source import resolve_model
from kvserve.models.loader import load_model
from kvserve.tokenizer import load_tokenizer

# (dtype, quantization, chunk): chunk = tokens per step, so that decode-sized kernels score the
# text (w4a8 rounds activations only in few-row steps); None = each window in one prefill.
MODES = [("float32", "none", None), ("bfloat16", "none", None), ("bfloat16", "int8", None),
         ("bfloat16", "int4", None), ("bfloat16", "w8a8", None), ("float32", "int4", 16),
         ("float32", "w4a8", 16), ("bfloat16", "gguf", None), ("bfloat16", "gguf", 16),
         ("float32", "gguf", 16)]
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--name", default="perplexity", help="the result files' name")
    parser.add_argument("--modes", default=None,
                        help="comma-separated dtype:quantization[:chunk] (default: all)")
    args = parser.parse_args()
    modes = MODES if not args.modes else [_mode(text) for text in args.modes.split(",")]
    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    tokens = tokenizer.encode(held_out_text(), add_special_tokens=False)
    # a window starts with BOS where the tokenizer adds one (Gemma; SmolLM2's adds none)
    with_special = tokenizer.encode("a")
    bos = with_special[0] if len(with_special) > len(tokenizer.encode(
        "a", add_special_tokens=False)) else None
    rows = []
    for dtype, quantization, chunk in modes:
        start = time.perf_counter()
        model, _ = load_model(source, dtype, attention_backend="paged", quantization=quantization)
        result = perplexity(model, tokens, args.window, max_windows=args.max_windows,
                            chunk=chunk, bos_token_id=bos)
        rows.append({"dtype": dtype, "quantization": quantization, "chunk": chunk, **result,
                     "seconds": time.perf_counter() - start})
        print(json.dumps(rows[-1]), flush=True)
        del model
    _write(rows, source.name, len(tokens), args.name)


def _write(rows: list[dict], model_name: str, num_tokens: int, name: str) -> None:
    from kvserve.bench.machine import cpu_label, machine_header
    from kvserve.bench.results import write_dated_result

    header = machine_header()
    base = rows[0]["perplexity"]
    lines = [f"# Perplexity by precision and quantization ({model_name})", "",
             f"Held-out text: docstrings of {', '.join(HELD_OUT_MODULES)} (Python "
             f"{'.'.join(map(str, __import__('sys').version_info[:3]))}, {num_tokens} tokens), "
             f"{rows[0]['windows']} windows of {rows[0]['window']} tokens, "
             f"{rows[0]['tokens_scored']} predictions. torch {torch.__version__}, CPU kernels on.",
             f"CPU: {cpu_label(header)}.",
             "Chunk: tokens per step (decode-sized kernels); - = each window in one prefill step.",
             "", "| dtype | quantization | chunk | perplexity | vs float32 |",
             "|---|---|---|---|---|"]
    for row in rows:
        delta = (row["perplexity"] / base - 1) * 100
        lines.append(f"| {row['dtype']} | {row['quantization']} | {row.get('chunk') or '-'} | "
                     f"{row['perplexity']:.4f} | {delta:+.2f}% |")
    print(write_dated_result(RESULTS, header, name, rows, lines).read_text())


def _mode(text: str) -> tuple[str, str, int | None]:
    dtype, quantization, *chunk = text.split(":")
    return dtype, quantization, int(chunk[0]) if chunk else None


if __name__ == "__main__":
    main()
