"""The step contract with several tokens per request per step: a test-only worker
(kvserve/testing/multi_token.py) emits 1-4 greedy tokens per request per step through the real
scheduler, output processor and server; text, token ids, stop strings and stop tokens,
max_tokens, n, logprobs, streaming and usage equal a one-token run."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.plugins import ENV_VAR as PLUGINS_ENV_VAR
from kvserve.testing import multi_token
from kvserve.testing.server import ServerProcess
from tests.helpers import assert_idle, tiny_server_flags

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def main():\n    return",
           "Paris is the capital of", "1, 2, 3, 4,", "A"]


def _cases(reference: LLM) -> list[tuple[str, SamplingParams]]:
    """Greedy requests whose stops fall mid-output: a stop string and a stop token taken from
    the one-token run's own output, max_tokens of every size, n = 2, logprobs."""
    plain = [(p, SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True))
             for i, p in enumerate(PROMPTS)]
    texts = reference.generate([p for p, _ in plain], [s for _, s in plain], use_tqdm=False)
    cases = plain + [(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
                     for p, m in zip(PROMPTS, (1, 2, 3, 5, 7, 9))]
    for output, (prompt, _) in zip(texts[:3], plain):
        sample = output.outputs[0]
        cases.append((prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                             stop=[sample.text[len(sample.text) // 2:][:3]])))
        cases.append((prompt, SamplingParams(temperature=0, max_tokens=20,
                                             stop_token_ids=[sample.token_ids[5]])))
    cases.append((PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, n=2,
                                             ignore_eos=True)))
    cases.append((PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, logprobs=3,
                                             ignore_eos=True)))
    return cases


def _summary(outputs) -> list[list[tuple]]:
    return [[(s.text, s.token_ids, s.finish_reason, s.stop_reason) for s in o.outputs]
            for o in outputs]


@pytest.fixture
def multi_token_llm(tiny_model_dir):
    multi_token.enable(True)
    before = multi_token.multi_token_steps()
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
              engine_core="thread", max_num_batched_tokens=64)
    yield llm, before
    llm.shutdown()
    multi_token.enable(False)


def test_offline_several_tokens_per_step_equal_one(tiny_llm, multi_token_llm):
    llm, steps_before = multi_token_llm
    cases = _cases(tiny_llm)
    prompts, params = [p for p, _ in cases], [s for _, s in cases]
    expected = tiny_llm.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert multi_token.multi_token_steps() > steps_before + len(cases)  # it really did
    assert _summary(got) == _summary(expected)
    for a, b in zip(got[-1].outputs[0].logprobs, expected[-1].outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    engine = llm.llm_engine.engine_core
    assert engine.kv_manager.pool.num_used_blocks == 0
    assert not engine.scheduler.has_unfinished()


@pytest.mark.multiprocess
def test_server_several_tokens_per_step_equal_one(tiny_llm, tiny_model_dir, tmp_path):
    """Non-streaming and streaming answers and usage from a server whose worker emits 1-4
    tokens per step equal the one-token offline run's."""
    cases = [(p, s) for p, s in _cases(tiny_llm) if s.n == 1]
    expected = tiny_llm.generate([p for p, _ in cases], [s for _, s in cases], use_tqdm=False)
    flags = tiny_server_flags(tiny_model_dir, "--max-num-batched-tokens", "64")
    env = {PLUGINS_ENV_VAR: multi_token.PLUGIN}
    with ServerProcess(flags, log_path=tmp_path / "server.log", env=env) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        multi_token_chunks = 0
        for (prompt, params), want in zip(cases, expected):
            body = _body(prompt, params)
            answer = client.post("/v1/completions", json=body).json()
            choice, sample = answer["choices"][0], want.outputs[0]
            assert (choice["text"], choice["finish_reason"]) == (sample.text,
                                                                 sample.finish_reason)
            assert answer["usage"]["completion_tokens"] == len(sample.token_ids)
            text, chunks = _stream(client, body)
            assert text == sample.text
            multi_token_chunks += sum(len((c.get("logprobs") or {}).get("tokens", [])) > 1
                                      for c in chunks)
        assert multi_token_chunks > 0  # streamed deltas carried several tokens at once
        assert_idle(server.base_url)


def _body(prompt: str, params: SamplingParams) -> dict:
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
            "ignore_eos": params.ignore_eos, "logprobs": 1}
    if params.stop:
        body["stop"] = params.stop
    if params.stop_token_ids:
        body["stop_token_ids"] = params.stop_token_ids
    return body


def _stream(client: httpx.Client, body: dict) -> tuple[str, list[dict]]:
    chunks = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    return "".join(c["text"] for c in chunks), chunks
