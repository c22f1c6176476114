"""The naive baseline: HF transformers `generate` on the bundled GGUF, batch 1 and a static
batch, greedy with EOS ignored. Usage: hf_generate.py [--batch 32] [--input-len 256]"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from kvserve.bench.workloads import TextSource, random_workload
from kvserve.model_source import resolve_model
from kvserve.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    source = resolve_model()
    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.bfloat16).eval()
    tokenizer = load_tokenizer(source)
    specs = random_workload(TextSource(tokenizer, 0), args.batch, args.input_len, 1)
    ids = torch.tensor([tokenizer.encode(s.prompt, False)[:args.input_len] for s in specs])
    results = {}
    for batch in (1, args.batch):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids[:batch], max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False)
        seconds = time.perf_counter() - start
        results[f"batch {batch}"] = {"output_tok_s": batch * args.output_len / seconds,
                                     "seconds": seconds}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
