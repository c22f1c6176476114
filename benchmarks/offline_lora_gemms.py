"""LoRA's long runs through GEMMs against the kernel's tiles only, in one process: the engine
core on a thread (engine_core="thread"), so the same engine's LoRA projections can be switched
between their autotuned GEMM limit and none (every row through the tiles) round by round, each
variant timed as the base model's batch against the same batch over 4 adapters. Paired in one
process because this VM drifts by more than the difference between two runs.

Needs the autotuner's table for these shapes (run once with KVSERVE_AUTOTUNE=blocking, or let a
server tune in the background); a shape without it keeps NO_LIMIT in both variants.

Usage: .venv/bin/python benchmarks/offline_lora_gemms.py [--rounds 4] [--max-tokens 1]
Writes benchmarks/results/<cpu>/<date>-lora-gemms.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_batching import make_prompts  # noqa: E402
from offline_lora import make_adapters  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.bench.machine import cpu_label, machine_header  # noqa: E402
from kvserve.bench.results import write_dated_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def set_limits(limits: dict[int, int] | None) -> None:
    """Every LoRA projection's GEMM limit (None: the tiles only), and the decode stacks rebuilt
    so they record it."""
    from kvserve.kernels import autotune
    from kvserve.models.layers.decoder import DecoderModel
    from kvserve.models.lora.slots import LinearLoRA

    for obj in gc.get_objects():
        if isinstance(obj, LinearLoRA):
            obj.max_rows = autotune.NO_LIMIT if limits is None else limits[id(obj)]
        elif isinstance(obj, DecoderModel):
            obj.reset_decode_stack()


def main() -> None:
    from kvserve.models.lora.slots import LinearLoRA

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1, help="1: the prompts' prefill")
    args = parser.parse_args()
    header = machine_header()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        adapters = make_adapters(Path(scratch), 4, 16)
        llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=16, enable_prefix_caching=False,
                  engine_core="thread")
        prompts = [{"prompt_token_ids": p} for p in
                   make_prompts(llm.get_tokenizer(), args.num_prompts, args.prompt_len)]
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False,
                     lora_request=spread[:4])  # loads the adapters
        tuned = {id(o): o.max_rows for o in gc.get_objects() if isinstance(o, LinearLoRA)}
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for round_index in range(args.rounds):
            order = ("tiles", "gemms") if round_index % 2 == 0 else ("gemms", "tiles")
            for variant in order:
                set_limits(None if variant == "tiles" else tuned)
                seconds = {}
                for name, loras in (("base", None), ("4 adapters", spread)):
                    start = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
                    seconds[name] = time.perf_counter() - start
                rows.append({"round": round_index + 1, "variant": variant, **seconds,
                             "base_over_adapters": seconds["base"] / seconds["4 adapters"]})
        llm.shutdown()
    args.limits = sorted(set(tuned.values()))
    args.load = (load_before, os.getloadavg()[0])
    print("\n".join(write_dated_result(RESULTS, header, "lora-gemms", rows,
                                       markdown(rows, args, header)).read_text().splitlines()))


def markdown(rows: list[dict], args, header: dict) -> list[str]:
    lines = ["# LoRA: long runs of one adapter through GEMMs against the tiles only", "",
             f"CPU: {cpu_label(header)}. SmolLM2-135M, default dtype, one engine (core on a "
             f"thread), 4 slots of rank 16; {args.num_prompts} prompts of {args.prompt_len} "
             f"tokens, {args.max_tokens} output token(s) each, all in one `generate`, on the "
             "base or spread over 4 adapters; the LoRA projections switched between their "
             f"autotuned GEMM limits ({args.limits} rows) and none, alternated per round. "
             "`benchmarks/offline_lora_gemms.py`.", "",
             "| round | variant | base s | 4 adapters s | base / 4 adapters |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['variant']} | {r['base']:.2f} | "
                     f"{r['4 adapters']:.2f} | {r['base_over_adapters']:.3f} |")
    for variant in ("tiles", "gemms"):
        values = [r["base_over_adapters"] for r in rows if r["variant"] == variant]
        lines.append("")
        lines.append(f"{variant}: median base / 4 adapters {statistics.median(values):.3f} "
                     f"({', '.join(f'{v:.2f}' for v in values)})")
    lines += ["", f"1-minute load average: {args.load[0]:.1f} before, {args.load[1]:.1f} after."]
    return lines


if __name__ == "__main__":
    main()
