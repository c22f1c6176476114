"""Gemma 3 270M (the real Q4_K_M GGUF: 18 layers, 5 of every 6 with a 512-token window, local and
global RoPE bases, QK-norm, Gemma's (1 + w) norms around attention and MLP, GeGLU, a 262k
vocabulary) against HF transformers loading the same file in float32: last-position logits
within 1e-3 on prompts up to 2,100 tokens (four windows long), greedy tokens equal batched and
alone at every kernel level, and through the engine chunked and from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_source import resolve_model
from kvserve.models import load_model
from kvserve.models.paged_loop import PagedLoop
from kvserve.tokenizer import load_tokenizer
from tests.helpers import assert_engine_chunked_and_cached_match, gguf_parsed_once, long_text

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

NEW_TOKENS, NEAR_TIE = 8, 0.02
PROMPT_SPANS = [(0, 2100), (100, 700), (0, 30)]  # token ranges of long_text(): 4 windows to 30


@pytest.fixture(scope="module")
def gemma():
    """Prompts cut from real text, HF's last-position logits for each and its greedy tokens
    (with the top-2 margins along the way, to tell a near-tie from a real divergence)."""
    source = resolve_model("gemma3-270m")
    ids = load_tokenizer(source).encode(long_text())
    prompts = [ids[start:end] for start, end in PROMPT_SPANS]
    with gguf_parsed_once():
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32).eval()
    logits, tokens, margins = [], [], []
    with torch.no_grad():
        for prompt in prompts:
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0,
                                    output_logits=True, return_dict_in_generate=True)
            logits.append(out.logits[0][0].float())
            tokens.append(out.sequences[0, len(prompt):].tolist())
            top2 = torch.stack([step[0].topk(2).values for step in out.logits])
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
    del hf_model
    return {"source": source, "prompts": prompts, "logits": logits, "tokens": tokens,
            "margins": margins}


def assert_tokens_match(got: list[int], expected: list[int], margins: list[float]) -> None:
    """Equal, or first different where HF's own top two were within NEAR_TIE."""
    if got == expected:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    assert margins[first] < NEAR_TIE, f"diverged at {first} (HF margin {margins[first]:.4f})"


def greedy_and_prefill_logits(loop: PagedLoop, prompts: list[list[int]], new_tokens: int):
    """`loop.greedy(prompts, new_tokens)`, and the last-position logits of its first step (the
    prefill of every prompt in one ragged batch): one prefill where a test checks both."""
    steps, step = [], loop.step

    def recording_step(*args, **kwargs):
        steps.append(step(*args, **kwargs))
        return steps[-1]

    loop.step = recording_step
    return loop.greedy(prompts, new_tokens), steps[0]


def test_logits_and_greedy_tokens_match_hf(gemma, isa_level):
    model, config = load_model(gemma["source"], "float32", attention_backend="paged")
    assert config.sliding_windows.count(512) == 15 and config.vocab_size == 262144
    prompts = gemma["prompts"]
    batched, got = greedy_and_prefill_logits(PagedLoop(model, len(prompts), 4096), prompts,
                                             NEW_TOKENS)
    for ours, theirs in zip(got, gemma["logits"]):
        torch.testing.assert_close(ours.float(), theirs, atol=1e-3, rtol=0)
    for i, prompt in enumerate(prompts):
        alone = PagedLoop(model, 1, 4096).greedy([prompt], NEW_TOKENS)[0]
        assert batched[i] == alone
        assert_tokens_match(alone, gemma["tokens"][i], gemma["margins"][i])


def test_sliding_windows_matter(gemma):
    """The parity above means something: attending past the window moves the 2,100-token
    prompt's logits far off HF's."""
    model, _ = load_model(gemma["source"], "float32", attention_backend="paged")
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 0
    prompt = gemma["prompts"][0]
    logits = PagedLoop(model, 1, 4096).step([prompt], [len(prompt)], [0])[0]
    assert (logits.float() - gemma["logits"][0]).abs().max() > 0.1


def test_engine_chunked_prefill_and_prefix_hits_match_hf(gemma):
    prompts = gemma["prompts"][1:]
    for got_tokens in (gemma["tokens"][1:],):
        assert_engine_chunked_and_cached_match(gemma["source"].path, prompts, got_tokens,
                                               NEW_TOKENS, chunk_tokens=256)
