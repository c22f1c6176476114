"""Memory pressure: a KV pool far smaller than the offered load. Requests are preempted and
resumed (by recompute) and still produce the same greedy tokens as with a large pool; a request
that could never fit is rejected up front with a 400, nothing queued.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import ContextLengthExceededError
from kvserve.testing.server import ServerProcess
from tests.helpers import assert_idle, tiny_server_flags

SMALL_POOL_BLOCKS = 16  # 256 tokens: room for about two of the requests below at a time
MAX_TOKENS = 48  # long enough that the requests overlap even when they arrive spread out
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    # 6 prompts of 60-160 tokens: together ~3.5x what the small pool holds
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(60 + 20 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def small_llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=SMALL_POOL_BLOCKS,
               block_size=16, engine_core="thread")


@pytest.fixture(scope="module")
def expected(tiny_llm):
    outputs = tiny_llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY,
                                use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]


def test_small_pool_preempts_and_matches_large_pool(small_llm, expected):
    engine = small_llm.llm_engine
    preemptions = engine.engine_core.scheduler.num_preemptions
    outputs = small_llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY,
                                 use_tqdm=False)
    assert engine.engine_core.scheduler.num_preemptions > preemptions
    assert any(o.metrics.num_preemptions for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == [ids for ids, _ in expected]
    assert engine.engine_core.kv_manager.pool.num_used_blocks == 0


def test_request_that_can_never_fit_is_rejected_up_front(small_llm):
    engine = small_llm.llm_engine
    assert engine.max_model_len == SMALL_POOL_BLOCKS * 16
    with pytest.raises(ContextLengthExceededError):
        small_llm.generate({"prompt_token_ids": [5] * 200},
                           SamplingParams(max_tokens=100), use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_server_under_memory_pressure(tiny_model_dir, tmp_path, expected):
    flags = tiny_server_flags(tiny_model_dir, kv_blocks=SMALL_POOL_BLOCKS, max_model_len=256)
    with ServerProcess(flags, log_path=tmp_path / "server.log") as server:
        too_big = httpx.post(server.base_url + "/v1/completions", json={
            "prompt": [5] * 200, "max_tokens": 100})
        assert too_big.status_code == 400
        assert too_big.json()["error"]["code"] == "context_length_exceeded"

        async def all_at_once():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={
                    "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0}) for p in _prompts()))

        responses = asyncio.run(all_at_once())
        metrics = assert_idle(server.base_url)
    assert [r.status_code for r in responses] == [200] * len(responses)
    counts = [len(r.json()["choices"][0]["logprobs"]["tokens"]) for r in responses]
    assert counts == [MAX_TOKENS] * len(responses)
    assert metrics["kvserve:num_preemptions_total"] > 0
    assert [r.json()["choices"][0]["text"] for r in responses] == [t for _, t in expected]
    assert server.exit_code == 0
