"""The engine on the real model in float32: batching, chunking, prefix caching and preemption
never change greedy tokens; seeds are batch-independent."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine_config import EngineConfig
from tests.helpers import RAW_PROMPTS, bounded, long_text

# the real model's start-ups and the 24-prompt baseline (`alone`, each prompt alone on the
# reference backend: the file's longest part) count toward the first test that uses them
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NEW_TOKENS = 8


def _mixed_prompts(tokenizer) -> list[list[int]]:
    """24 ragged prompts, 8 of each kind: chats sharing the default system prompt (their first
    block the same), raw text (6 to 20 tokens: one partial block), and code excerpts of 60 to
    193 tokens (up to 13 blocks) whose last blocks fill to 8 different depths."""
    topics = ["the moon", "bread", "rivers", "prime numbers", "jazz", "volcanoes", "chess",
              "bees"]
    chats = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Tell me one fact about {topic}."}]), False)
        for topic in topics]
    raws = [tokenizer.encode(p + f" {i}") for i, p in enumerate(RAW_PROMPTS * 2)][:8]
    source = tokenizer.encode(long_text())
    longs = [source[i * 74: i * 74 + 60 + 19 * i] for i in range(8)]
    return chats + raws + longs


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return _mixed_prompts(tokenizer)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def alone(prompts):
    """The baseline: every prompt on its own, no prefix caching, no chunking, and the plain
    reference attention backend (every other test runs the default fast backend)."""
    llm = LLM(dtype="float32", enable_prefix_caching=False, max_model_len=1024,
              max_num_batched_tokens=1024, attention_backend="torch_ref")
    return [_greedy(llm, [p])[0] for p in prompts]


def test_24_prompts_in_one_batch_equal_each_alone(prompts, alone):
    assert len(prompts) == 24
    llm = LLM(dtype="float32", enable_prefix_caching=False, max_model_len=1024)
    assert _greedy(llm, prompts) == alone


def test_chunked_prefill_equals_unchunked(prompts, alone):
    llm = LLM(dtype="float32", enable_prefix_caching=False, max_model_len=1024,
              max_num_batched_tokens=32)
    assert _greedy(llm, prompts) == alone


def test_unchunked_prompts_longer_than_the_step_budget_still_run(prompts, alone):
    """Without chunked prefill a step takes whole prompts, so the budget rises to
    max_model_len: a prompt over --max-num-batched-tokens is not left waiting forever."""
    longest = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))[:3]
    assert len(prompts[longest[-1]]) > 32
    llm = LLM(dtype="float32", enable_prefix_caching=False, max_model_len=1024,
              max_num_batched_tokens=32, enable_chunked_prefill=False, engine_core="thread")
    assert llm.llm_engine.engine_core.scheduler.config.max_num_batched_tokens == 1024
    assert _greedy(llm, [prompts[i] for i in longest]) == [alone[i] for i in longest]


def test_the_default_step_budget_is_per_device():
    assert EngineConfig().max_num_batched_tokens == 512
    assert EngineConfig(device="cuda:1").max_num_batched_tokens == 2048
    assert EngineConfig(max_num_batched_tokens=64).max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(max_num_batched_tokens=0)


def test_prefix_caching_on_equals_off_and_hits(prompts, alone):
    llm = LLM(dtype="float32", enable_prefix_caching=True, max_model_len=1024,
              engine_core="thread")
    assert _greedy(llm, prompts) == alone
    stats = llm.llm_engine.engine_core.kv_manager.stats
    hits_after_first_pass = stats.hits
    # the second pass finds every prompt's full blocks cached (prompt and output kept)
    assert _greedy(llm, prompts) == alone
    assert stats.hits - hits_after_first_pass == sum((len(p) - 1) // 16 * 16 for p in prompts)


def test_tiny_pool_preempts_and_still_matches(prompts, alone):
    llm = LLM(dtype="float32", enable_prefix_caching=True, max_model_len=256, num_kv_blocks=24,
              block_size=16, engine_core="thread")
    assert _greedy(llm, prompts) == alone
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_seed_gives_same_samples_alone_and_batched(prompts):
    llm = LLM(dtype="float32", max_model_len=1024)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=2024, max_tokens=16)
    target = {"prompt_token_ids": prompts[3]}
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in prompts[10:20]]
    mixed = llm.generate(others[:5] + [target] + others[5:],
                         [SamplingParams(temperature=1.0, max_tokens=16)] * 5 + [seeded]
                         + [SamplingParams(temperature=0.7, max_tokens=9)] * 5, use_tqdm=False)
    assert mixed[5].outputs[0].token_ids == alone


def test_n4_allocates_the_prompt_blocks_once(prompts):
    llm = LLM(dtype="float32", max_model_len=1024, num_kv_blocks=64, engine_core="thread")
    engine = llm.llm_engine
    prompt = prompts[20]  # a long code excerpt: several full blocks and a partial one
    full_blocks = len(prompt) // 16
    engine.add_request("fan", {"prompt_token_ids": prompt},
                       SamplingParams(n=4, max_tokens=6, temperature=0.8, seed=5))
    saw_all_four = False
    for _ in bounded(100, "the fan-out"):
        if not engine.has_unfinished_requests():
            break
        tables = [engine.engine_core.kv_manager.block_ids(f"{i}_fan") for i in range(4)]
        if all(tables):
            saw_all_four = True
            assert len({tuple(t[:full_blocks]) for t in tables}) == 1
            used = engine.engine_core.kv_manager.pool.num_used_blocks
            assert used == full_blocks + 4 * (len(tables[0]) - full_blocks)
        final = engine.step()
    assert saw_all_four
    assert engine.engine_core.kv_manager.stats.hits == 3 * full_blocks * 16
    assert len(final[0].outputs) == 4
