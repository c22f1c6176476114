"""Engine throughput without HTTP: LLM.generate of 32 prompts of 256 tokens, 128 greedy tokens
each (ignore_eos), three timed passes after a warm-up, on the bundled SmolLM2. Run it with another
checkout first on PYTHONPATH to compare commits on the engine alone (the HTTP scenarios' rounds
vary by +-15% on our VMs; this isolates the core from the front-end and the client).

Usage: PYTHONPATH=/path/to/checkout .venv/bin/python benchmarks/offline_generate.py [MODE]
(MODE: a --quantization value, default auto). Prints the three passes' output tok/s.
"""

from __future__ import annotations

import os
import sys
import time

from kvserve import LLM, SamplingParams

PROMPTS, PROMPT_LEN, OUTPUT_LEN, PASSES = 32, 256, 128, 3


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
    llm = LLM(model="smollm2-135m-instruct", quantization=mode)
    tokenizer = llm.get_tokenizer()
    text = "The history of the lighthouse keepers on the northern coast is long and full of storms. "
    base = tokenizer.encode(text * 40, False)[:PROMPT_LEN]
    prompts = [{"prompt_token_ids": [(token + i) % 49000 for token in base]}
               for i in range(PROMPTS)]  # no shared prefix: each prompt is prefilled
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    rates = []
    for _ in range(PASSES):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(PROMPTS * OUTPUT_LEN / (time.perf_counter() - start))
    print(os.environ.get("PYTHONPATH", "."), mode, [round(rate, 1) for rate in rates])
    llm.shutdown()


if __name__ == "__main__":
    main()
