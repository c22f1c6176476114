"""What LoRA adapters cost a batch: the same workload on one engine (`--enable-lora`, 4 slots of
rank 16) with every request on the base model, and with the requests spread over 4 adapters
(rank 16 on all seven projections, made by PEFT on HF's load of the model), in alternated
rounds. Offline (the LLM API) so the figure is the engine's, not the client's.

Usage: .venv/bin/python benchmarks/offline_lora.py [--rounds 3] [--num-prompts 32]
Writes benchmarks/results/<cpu>/<date>-lora-offline.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_batching import make_prompts  # noqa: E402

from kvserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from kvserve.bench.machine import cpu_label, machine_header  # noqa: E402
from kvserve.bench.results import write_dated_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(directory: Path, count: int, rank: int) -> list[LoRARequest]:
    """`count` random adapters on every projection, saved by PEFT from HF's load of SmolLM2."""
    import peft
    import torch
    import transformers

    from kvserve.model_source import resolve_model

    source = resolve_model("smollm2-135m-instruct")
    requests = []
    for index in range(count):
        torch.manual_seed(index)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS,
                                 init_lora_weights=False)
        path = directory / f"adapter-{index}"
        peft.get_peft_model(model, config).save_pretrained(path)
        requests.append(LoRARequest(f"adapter-{index}", index + 1, str(path)))
    return requests


def timed(llm: LLM, prompts, params, loras) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--name", default="lora-offline", help="the result file's name")
    parser.add_argument("--note", default="", help="a line for the result (what changed)")
    args = parser.parse_args()
    header = machine_header()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        adapters = make_adapters(Path(scratch), 4, args.rank)
        llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=args.rank,
                  enable_prefix_caching=False)
        prompts = [{"prompt_token_ids": p} for p in
                   make_prompts(llm.get_tokenizer(), args.num_prompts, args.prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        timed(llm, prompts[:4], params, spread[:4])  # loads the adapters, warms up
        rows = []
        for round_index in range(args.rounds):
            order = ("base", "4 adapters") if round_index % 2 == 0 else ("4 adapters", "base")
            for variant in order:
                seconds = timed(llm, prompts, params, None if variant == "base" else spread)
                rows.append({"round": round_index + 1, "variant": variant, "seconds": seconds,
                             "tok_s": len(prompts) * args.max_tokens / seconds})
        llm.shutdown()
    args.load = (load_before, os.getloadavg()[0])
    print("\n".join(write_dated_result(RESULTS, header, args.name, rows,
                                       markdown(rows, args, header)).read_text().splitlines()))


def markdown(rows: list[dict], args, header: dict) -> list[str]:
    median = {variant: statistics.median(r["tok_s"] for r in rows if r["variant"] == variant)
              for variant in ("base", "4 adapters")}
    lines = ["# LoRA: a batch spread over 4 adapters against the base, offline", "",
             f"CPU: {cpu_label(header)}. SmolLM2-135M, default dtype, `LLM(enable_lora=True, "
             f"max_loras=4, max_lora_rank={args.rank})`; {args.num_prompts} prompts of "
             f"{args.prompt_len} tokens, {args.max_tokens} output tokens each (greedy, "
             "ignore_eos), all in one `generate`; every request on the base, or request i on "
             f"adapter i mod 4 (rank {args.rank} on all seven projections). {args.rounds} "
             "alternated rounds. `benchmarks/offline_lora.py`.", "",
             "| variant | out tok/s (median) | rounds |", "|---|---|---|"]
    for variant, value in median.items():
        each = ", ".join(f"{r['tok_s']:.0f}" for r in rows if r["variant"] == variant)
        lines.append(f"| {variant} | {value:.0f} | {each} |")
    paired = [next(r["tok_s"] for r in rows if r["round"] == n and r["variant"] == "4 adapters")
              / next(r["tok_s"] for r in rows if r["round"] == n and r["variant"] == "base")
              for n in sorted({r["round"] for r in rows})]
    lines += ["", f"4 adapters / base: {median['4 adapters'] / median['base']:.2f}x of the "
              f"medians; per round {', '.join(f'{x:.2f}' for x in paired)}, median "
              f"{statistics.median(paired):.2f}x.", "",
              f"1-minute load average: {args.load[0]:.1f} before, {args.load[1]:.1f} after "
              "(2 cores: above ~2, other work shared the machine)."]
    if args.note:
        lines += ["", args.note]
    return lines


if __name__ == "__main__":
    main()
