"""Issue 33's tool-grammar figures: a 50-tool `tool_choice: "required"` request's grammar
compiles in under 50 ms p99, and does not slow other requests.

1. **Compile time**: `ROUNDS` distinct sets of 50 tools (new names each round, so every
   compile is a cache miss), each turned into the structural tag the server builds
   (`tools/grammar.py`, Hermes format, parallel calls) and compiled by the engine's compiler
   against SmolLM2's vocabulary, one at a time; also the front-end's check (`validate`).
2. **Others' inter-token gaps**: free-text requests decode on the real model (thread core)
   while 50-tool `required` requests arrive every `--every` seconds. Run twice: every tool
   request with the same, already compiled grammar ("cached"), then each with a new one
   ("new"). The tool requests join the batch either way; the difference between the two
   runs' gaps is what the compiles cost the others.

Usage: .venv/bin/python benchmarks/tool_grammar.py [--name NAME]  (nothing else running)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.entrypoints.openai.tools.formats import HERMES
from kvserve.entrypoints.openai.tools.grammar import tool_structural_tag
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.compiler import GrammarCompiler, validate

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS = 60
NUM_TOOLS = 50
FREE_REQUESTS = 4
FREE_TOKENS = 160
TOOL_REQUESTS = 8


def tool_set(round_: int) -> list[dict]:
    """50 tools with names of this round's own (a cache miss each round), each with a few
    typed parameters like real tools have."""
    return [{"type": "function", "function": {
        "name": f"tool_{round_}_{i}", "description": f"Tool number {i}.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1},
            "mode": {"enum": ["fast", "exact", "auto"]},
            "filters": {"type": "array", "items": {"type": "string"}}},
            "required": ["query"], "additionalProperties": False}}}
        for i in range(NUM_TOOLS)]


def required_spec(round_: int) -> StructuredOutputsParams:
    tag = tool_structural_tag(tool_set(round_), "required", True, HERMES)
    return StructuredOutputsParams(structural_tag=tag)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def compile_times(tokenizer) -> dict:
    compiler = GrammarCompiler(lambda: tokenizer, tokenizer.vocab_size)
    compiler.warm_up().result()
    compile_ms, validate_ms = [], []
    for round_ in range(ROUNDS):
        spec = required_spec(10_000 + round_)
        start = time.perf_counter()
        validate(spec)
        validate_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        compiler.submit(spec).result()
        compile_ms.append((time.perf_counter() - start) * 1e3)
    compiler.shutdown()
    return {"compile_ms_p50": statistics.median(compile_ms),
            "compile_ms_p99": percentile(compile_ms, 0.99), "compile_ms_max": max(compile_ms),
            "validate_ms_p50": statistics.median(validate_ms),
            "validate_ms_p99": percentile(validate_ms, 0.99)}


def others_gaps(llm: LLM, fresh: bool, every_s: float, first_round: int) -> dict:
    """Free requests' inter-token gaps (ms) while tool requests arrive."""
    engine = llm.llm_engine
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    tool_prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Look up the weather in Paris with a tool."}])
    for index in range(FREE_REQUESTS):
        engine.add_request(f"free-{index}", prompt, SamplingParams(
            temperature=0.8, seed=index, max_tokens=FREE_TOKENS, ignore_eos=True))
    last: dict[str, float] = {}
    gaps: list[float] = []
    sent, next_at = 0, time.perf_counter() + every_s
    while engine.has_unfinished_requests():
        now = time.perf_counter()
        if sent < TOOL_REQUESTS and now >= next_at:
            round_ = first_round + sent if fresh else first_round
            engine.add_request(f"tool-{first_round}-{sent}", tool_prompt, SamplingParams(
                temperature=0, max_tokens=24, structured_outputs=required_spec(round_)))
            sent, next_at = sent + 1, now + every_s
        for output in engine.step(timeout=0.01):
            if not output.request_id.startswith("free"):
                continue
            stamp = time.perf_counter()
            if output.request_id in last:
                gaps.append((stamp - last[output.request_id]) * 1e3)
            last[output.request_id] = stamp
    return {"gap_ms_p50": statistics.median(gaps), "gap_ms_p90": percentile(gaps, 0.9),
            "gap_ms_p99": percentile(gaps, 0.99), "gap_ms_max": max(gaps),
            "tool_requests": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-tool-grammar")
    parser.add_argument("--every", type=float, default=0.25,
                        help="seconds between tool requests")
    args = parser.parse_args()
    header = machine_header()
    with LLM(engine_core="thread", max_model_len=2048) as llm:
        compiles = compile_times(llm.get_tokenizer())
        llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
        engine = llm.llm_engine
        engine.add_request("warm-grammar", "hi", SamplingParams(
            max_tokens=4, structured_outputs=required_spec(0)))
        while engine.has_unfinished_requests():
            engine.step(timeout=0.1)
        cached = others_gaps(llm, fresh=False, every_s=args.every, first_round=0)
        fresh = others_gaps(llm, fresh=True, every_s=args.every, first_round=1)
    out_dir = RESULTS / cpu_slug(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = "\n".join(f"| {label} | {r['gap_ms_p50']:.1f} | {r['gap_ms_p90']:.1f} | "
                     f"{r['gap_ms_p99']:.1f} | {r['gap_ms_max']:.1f} |"
                     for label, r in (("cached grammar", cached), ("new grammar each", fresh)))
    text = (
        f"# 50-tool `required` grammars, {args.name}\n\n"
        f"Machine: {cpu_label(header)}, {header['cores']} cores. `benchmarks/tool_grammar.py`, "
        "SmolLM2-135M-Instruct, default dtype, Hermes tool format, parallel calls.\n\n"
        f"**Compile** ({ROUNDS} distinct 50-tool sets, one at a time): p50 "
        f"{compiles['compile_ms_p50']:.1f} ms, p99 {compiles['compile_ms_p99']:.1f} ms, max "
        f"{compiles['compile_ms_max']:.1f} ms. The front-end's check: p50 "
        f"{compiles['validate_ms_p50']:.2f} ms, p99 {compiles['validate_ms_p99']:.2f} ms.\n\n"
        f"**Others' inter-token gaps** ({FREE_REQUESTS} free requests of {FREE_TOKENS} tokens; "
        f"{TOOL_REQUESTS} tool requests arrive every {args.every:g} s and join the batch):\n\n"
        "| tool requests | gap p50 ms | p90 | p99 | max |\n|---|---|---|---|---|\n"
        + rows + "\n")
    (out_dir / f"{args.name}.md").write_text(text)
    (out_dir / f"{args.name}.json").write_text(json.dumps(
        {"machine": header, "compile": compiles, "cached": cached, "new": fresh}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
