"""Offline s7 (code edit, one request at a time) under several draft settings, alternated.

Why: this VM drifts by 10-20% over minutes, so settings run one after another cannot be told
apart. Here every setting has its own `LLM` (engine core on a thread) in one process, and each
prompt is run by every setting in turn before the next prompt; the figure per setting is its
median TPOT over the prompts, and the ratio is the first setting's over it. No HTTP and no
client: an upper bound on what a server sees, for choosing between settings (then confirm with
`spec_paired.py`).

Usage: .venv/bin/python benchmarks/spec_offline_ab.py [--max-drafts 0,8,16,24] [--prompts 16]
0 is drafting off; any other number is suffix drafts with that num_speculative_tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.bench import workloads

INPUT_TOKENS, OUTPUT_TOKENS = 256, 128  # s7's shape (benchmarks/run.py)


def make_llm(max_drafts: int) -> LLM:
    if max_drafts == 0:
        return LLM(engine_core="thread")
    return LLM(engine_core="thread", speculative_config={
        "method": "suffix", "num_speculative_tokens": max_drafts})


def request_tpot_ms(llm: LLM, request_id: str, prompt, params: SamplingParams) -> float:
    """Milliseconds per output token after the first, stepping the engine directly."""
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params)
    engine.step()  # the prompt and the first token
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - started) / (params.max_tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-drafts", default="0,8,16")
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    settings = [int(value) for value in args.max_drafts.split(",")]
    llms = {setting: make_llm(setting) for setting in settings}
    tokenizer = llms[settings[0]].get_tokenizer()
    specs = workloads.code_edit_workload(workloads.TextSource(tokenizer, 0), args.prompts,
                                         INPUT_TOKENS, OUTPUT_TOKENS)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0)
    for llm in llms.values():  # warm-up: first calls of each shape
        llm.generate([specs[0].prompt], params, use_tqdm=False)
    tpots: dict[int, list[float]] = {setting: [] for setting in settings}
    for index, spec in enumerate(specs):
        for setting, llm in llms.items():
            tpots[setting].append(request_tpot_ms(llm, f"ab-{index}", spec.prompt, params))
    first = statistics.median(tpots[settings[0]])
    for setting in settings:
        median = statistics.median(tpots[setting])
        label = "off" if setting == 0 else f"suffix, {setting} drafts"
        print(f"{label}: TPOT median {median:.2f} ms, {first / median:.2f}x of the first")


if __name__ == "__main__":
    main()
