"""Latent attention's smaller cache as concurrency: the same KV budget, long prompts all at once,
on a DeepSeek-shaped model (MLA) and its GQA twin. Records each model's KV bytes per token (the
engine's page layout, all layers), the KV blocks the budget gives, the most requests running at
once (the scheduler's running list, polled every step) and the time the batch took, with the
CPU named; written to benchmarks/results/<cpu>/<name>.md and .json.

In process (LLM's engine, core on a thread, stepped here), not through the server: the figure is
the scheduler's, which the HTTP path does not change.

Usage: .venv/bin/python benchmarks/mla_concurrency.py --models MLA_DIR,GQA_DIR \
           [--kv-bytes 268435456] [--prompt-len 2048] [--requests 32] [--output-len 8] --name N
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def run(model: str, kv_bytes: int, prompt_len: int, requests: int, output_len: int) -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM(model=model, kv_cache_memory_bytes=kv_bytes, max_num_seqs=requests,
              max_model_len=prompt_len + output_len + 16, engine_core="thread",
              enable_prefix_caching=False)
    try:
        engine = llm.llm_engine
        core = engine.core.core  # the in-process client's EngineCore
        page = core.executor.kv_page_bytes
        layers = core.model_config.num_hidden_layers
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        for index in range(requests):  # distinct prompts: no prefix shared
            prompt = [(7 + index * 131 + position * 17) % 30000 + 100
                      for position in range(prompt_len)]
            engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
        peak, start, steps = 0, time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            peak = max(peak, len(core.scheduler.running))
        seconds = time.perf_counter() - start
        return {"model": model, "kv_bytes_per_token": page * layers,
                "kv_page_bytes_per_layer": page, "layers": layers,
                "kv_blocks": core.num_kv_blocks, "block_size": core.config.block_size,
                "tokens_per_request": prompt_len + output_len,
                "fit_by_blocks": core.num_kv_blocks * core.config.block_size
                // (prompt_len + output_len),
                "peak_running": peak, "steps": steps, "seconds": round(seconds, 2),
                "output_tok_per_s": round(requests * output_len / seconds, 2)}
    finally:
        llm.shutdown()


def main() -> None:
    from kvserve.bench.machine import cpu_label, cpu_slug, machine_header

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="comma-separated model references")
    parser.add_argument("--kv-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    machine = machine_header()
    rows = [run(model, args.kv_bytes, args.prompt_len, args.requests, args.output_len)
            for model in args.models.split(",")]
    result = {"machine": machine, "kv_bytes": args.kv_bytes, "prompt_len": args.prompt_len,
              "requests": args.requests, "output_len": args.output_len, "rows": rows}
    folder = RESULTS / cpu_slug(machine)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# {args.name}: concurrency at a fixed KV budget", "",
             f"CPU: {cpu_label(machine)}. KV budget {args.kv_bytes / 2**20:.0f} MiB, "
             f"{args.requests} prompts of {args.prompt_len} tokens at once, "
             f"{args.output_len} output tokens each, prefix caching off.", "",
             "| model | KV bytes / token | KV blocks | requests that fit | peak running | "
             "seconds | output tok/s |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {Path(row['model']).name} | {row['kv_bytes_per_token']:,} | "
                     f"{row['kv_blocks']:,} | {row['fit_by_blocks']} | {row['peak_running']} | "
                     f"{row['seconds']} | {row['output_tok_per_s']} |")
    (folder / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
