"""xgrammar against llguidance on the schemas that hurt: should llguidance be a second backend?

xgrammar compiles a grammar ahead (its token masks precomputed where they do not depend on the
stack): fast masks, but a string with maxLength 80 took ~3.5 s to compile on Zen 3, since it
expands bounded repetition. llguidance builds masks lazily (no ahead-of-time compile), so
it starts at once and pays per step. For each schema: xgrammar's compile and its mean mask
fill per token; llguidance's matcher creation and its mean mask per token, both walking the
same token sequence (a valid instance of the schema, tokenized), against SmolLM2's vocabulary,
one thread.

Usage: .venv/bin/python benchmarks/grammar_backends.py [--name NAME]  (needs `pip install
llguidance==1.9.1`; nothing else running)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvserve.bench.machine import cpu_label, cpu_slug, machine_header
from kvserve.model_source import resolve_model
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.compiler import GrammarCompiler
from kvserve.tokenizer import load_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"


def _bounded(length: int) -> tuple[dict, dict]:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": length},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
        "required": ["name", "tags"], "additionalProperties": False}
    return schema, {"name": "Ada Lovelace, first programmer"[:length], "tags": ["math", "poet"]}


def cases() -> dict[str, tuple[dict, dict]]:
    return {f"string maxLength {n}": _bounded(n) for n in (20, 80, 200)} | {
        "no bounds": ({"type": "object", "properties": {"name": {"type": "string"}, "tags": {
            "type": "array", "items": {"type": "string"}}}, "required": ["name", "tags"],
            "additionalProperties": False}, {"name": "Ada Lovelace", "tags": ["math"]})}


def corpus_starts(compiler, ll_tokenizer) -> dict:
    """Start-up only (compile / matcher creation) over the tests' 32-schema corpus."""
    import llguidance

    corpus = json.loads((Path(__file__).resolve().parents[1] / "tests" / "data" /
                         "json_schemas.json").read_text())
    xg, ll = [], []
    for entry in corpus:
        start = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=entry["schema"])).result()
        xg.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
            entry["schema"], defaults={"whitespace_flexible": False}))
        ll.append((time.perf_counter() - start) * 1e3)
    return {"xgrammar_ms": sorted(xg), "llguidance_ms": sorted(ll)}


def time_xgrammar(compiler, schema: dict, tokens: list[int]) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    grammar = compiler.submit(StructuredOutputsParams(json=schema)).result()
    compile_ms = (time.perf_counter() - start) * 1e3
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    start = time.perf_counter()
    for token in tokens:
        matcher.fill_next_token_bitmask(bitmask, 0)
        assert matcher.accept_token(token), "xgrammar refused the instance"
    mask_us = (time.perf_counter() - start) * 1e6 / len(tokens)
    return {"start_ms": compile_ms, "mask_us": mask_us}


def time_llguidance(ll_tokenizer, schema: dict, tokens: list[int], vocab: int) -> dict:
    import llguidance

    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    start_ms = (time.perf_counter() - start) * 1e3
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    start = time.perf_counter()
    for token in tokens:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        assert matcher.consume_token(token), matcher.get_error()
    mask_us = (time.perf_counter() - start) * 1e6 / len(tokens)
    return {"start_ms": start_ms, "mask_us": mask_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-grammar-backends")
    args = parser.parse_args()
    import llguidance
    import llguidance.hf
    import transformers

    torch.set_num_threads(1)
    header = machine_header()
    tokenizer = load_tokenizer(resolve_model(None))
    vocab = tokenizer.vocab_size
    compiler = GrammarCompiler(lambda: tokenizer, vocab, max_workers=1)
    compiler.warm_up().result()
    ll_tokenizer = llguidance.hf.from_tokenizer(
        transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
        n_vocab=vocab)
    rows, records = [], {}
    for label, (schema, instance) in cases().items():
        text = json.dumps(instance, separators=(",", ":"))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        xg = time_xgrammar(compiler, schema, tokens)
        ll = time_llguidance(ll_tokenizer, schema, tokens, vocab)
        records[label] = {"tokens": len(tokens), "xgrammar": xg, "llguidance": ll}
        rows.append(f"| {label} | {len(tokens)} | {xg['start_ms']:.1f} | {xg['mask_us']:.0f} | "
                    f"{ll['start_ms']:.1f} | {ll['mask_us']:.0f} |")
    starts = corpus_starts(compiler, ll_tokenizer)
    records["corpus starts"] = starts
    compiler.shutdown()
    xs, ls = starts["xgrammar_ms"], starts["llguidance_ms"]
    text = (f"# xgrammar and llguidance, {args.name}\n\nMachine: {cpu_label(header)}. "
            "`benchmarks/grammar_backends.py`: SmolLM2's vocabulary (49,152), one thread; "
            "xgrammar 0.2.8 (compile, then fill_next_token_bitmask), llguidance "
            f"{llguidance.get_version() if hasattr(llguidance, 'get_version') else ''} "
            "(matcher creation, then its mask), each walking a valid instance's tokens.\n\n"
            "| schema | tokens | xgrammar compile ms | xgrammar mask us/token | "
            "llguidance start ms | llguidance mask us/token |\n|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n\n"
            f"The tests' 32-schema corpus, start-up only: xgrammar compile p50 "
            f"{xs[len(xs) // 2]:.1f} ms, max {xs[-1]:.1f} ms (total {sum(xs):.0f} ms); "
            f"llguidance p50 {ls[len(ls) // 2]:.1f} ms, max {ls[-1]:.1f} ms (total "
            f"{sum(ls):.0f} ms).\n")
    out_dir = RESULTS / cpu_slug(header)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.md").write_text(text)
    (out_dir / f"{args.name}.json").write_text(json.dumps(
        {"machine": header, "results": records}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
