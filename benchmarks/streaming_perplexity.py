"""Attention sinks (StreamingLLM) reproduced: perplexity over a >16k-token text read as one
stream with a 1k window, with sinks, without them, and against the in-window reference (each
token scored with 1k-1.25k tokens of full-attention context, recomputed), plus the most KV the
stream held. Writes benchmarks/results/<cpu>/<date>-streaming-perplexity.{md,json}.

Usage: .venv/bin/python benchmarks/streaming_perplexity.py [--window 1024] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvserve.bench.machine import cpu_label, machine_header
from kvserve.bench.perplexity import (
    LONG_TEXT_MODULES,
    held_out_text,
    streaming_perplexity,
    strided_perplexity,
)
from kvserve.bench.results import write_dated_result
from kvserve.model_source import resolve_model
from kvserve.models.loader import load_model
from kvserve.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per step")
    parser.add_argument("--tokens", type=int, default=None, help="score the first N tokens")
    parser.add_argument("--runs", default="reference,sinks,sinks-bf16,window",
                        help="which of reference, sinks, sinks-bf16, window (comma list)")
    parser.add_argument("--name", default="streaming-perplexity", help="result files' name")
    args = parser.parse_args()
    source = resolve_model(args.model)
    tokens = load_tokenizer(source).encode(held_out_text(LONG_TEXT_MODULES),
                                           add_special_tokens=False)[:args.tokens]
    model, _ = load_model(source, "float32", attention_backend="paged", quantization="none")
    runs = {"reference": ("in-window reference (full attention, recomputed)",
                          lambda: strided_perplexity(model, tokens, args.window, args.chunk)),
            "sinks": ("sinks (4 tokens -> 1 block) + window, float32 KV",
                      lambda: streaming_perplexity(model, tokens, args.window, 4, args.chunk)),
            "sinks-bf16": ("sinks + window, bfloat16 KV",
                           lambda: streaming_perplexity(model, tokens, args.window, 4,
                                                        args.chunk, kv_dtype=torch.bfloat16)),
            "window": ("window only (no sinks), float32 KV",
                       lambda: streaming_perplexity(model, tokens, args.window, 0, args.chunk))}
    rows = []
    for name, run in (runs[key] for key in args.runs.split(",")):
        start = time.perf_counter()
        rows.append({"run": name, **run(), "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    _write(rows, source.name, len(tokens), args)




def _write(rows: list[dict], model_name: str, num_tokens: int, args) -> None:
    header = machine_header()
    base = rows[0]["perplexity"]
    lines = [f"# Attention sinks: perplexity of one {num_tokens}-token stream ({model_name})", "",
             f"Text: docstrings of {', '.join(LONG_TEXT_MODULES)}. Window {args.window} tokens, "
             f"{args.chunk} tokens a step, float32 weights. CPU: {cpu_label(header)}. "
             f"torch {torch.__version__}.", "",
             "| run | perplexity | vs the first row | most KV held (tokens) | seconds |",
             "|---|---|---|---|---|"]
    for row in rows:
        delta = (row["perplexity"] / base - 1) * 100
        held = row.get("max_kv_tokens", "-")
        lines.append(f"| {row['run']} | {row['perplexity']:.3f} | {delta:+.1f}% | {held} | "
                     f"{row['seconds']} |")
    print(write_dated_result(RESULTS, header, args.name, rows, lines).read_text())


if __name__ == "__main__":
    main()
