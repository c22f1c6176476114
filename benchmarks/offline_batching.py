"""Continuous batching vs one prompt at a time through the offline LLM API.

Usage: .venv/bin/python benchmarks/offline_batching.py [--num-prompts 64] [--max-tokens 32]
Prints both wall times and the speed-up; with --output, appends a markdown row.
"""

from __future__ import annotations

import argparse
import inspect
import platform
import textwrap
import time

from kvserve import LLM, SamplingParams


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """Prompts cut from real text (the standard library's source), `length` tokens each."""
    source = tokenizer.encode(inspect.getsource(textwrap) + inspect.getsource(argparse))
    return [source[(i * 97) % (len(source) - length):][:length] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", default=None, help="markdown file to append results to")
    args = parser.parse_args()

    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p}
               for p in make_prompts(llm.get_tokenizer(), args.num_prompts, args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up

    start = time.perf_counter()
    batched = llm.generate(prompts, params, use_tqdm=False)
    batched_s = time.perf_counter() - start
    start = time.perf_counter()
    sequential = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    sequential_s = time.perf_counter() - start

    same = [b.outputs[0].token_ids for b in batched] == [s.outputs[0].token_ids
                                                          for s in sequential]
    tokens = args.num_prompts * args.max_tokens
    row = (f"| {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()} | "
           f"{llm.llm_engine.dtype} | {args.num_prompts} x {args.prompt_len}/{args.max_tokens} | "
           f"{batched_s:.1f} s ({tokens / batched_s:.0f} tok/s) | "
           f"{sequential_s:.1f} s ({tokens / sequential_s:.0f} tok/s) | "
           f"{sequential_s / batched_s:.1f}x | {'yes' if same else 'NO'} |")
    print("| date | machine | dtype | prompts | batched | one at a time | speed-up | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    print(row)
    if args.output:
        with open(args.output, "a") as handle:
            handle.write(row + "\n")


if __name__ == "__main__":
    main()
