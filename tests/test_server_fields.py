"""The request fields the server takes and refuses, on the tiny model: every field it does not
implement is a 400 naming it (no silent prose with 200 OK), what real clients send (the openai
client, `vllm bench serve`) still passes, and a custom logits processor loaded by flag
(--logits-processors) applies to exactly the requests whose vllm_xargs ask for it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve.testing.server import ServerProcess
from kvserve.testing.tiny import tiny_config

pytestmark = pytest.mark.multiprocess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fields-server") / "server.log"
    flags = ["--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "128",
             "--max-model-len", "512", "--served-model-name", "tiny",
             "--logits-processors", "kvserve.testing.logits_processors:BanTokens"]
    with ServerProcess(flags, log_path=log) as process:
        yield process
    assert process.exit_code == 0, log.read_text()[-3000:]


def post(server, path, payload):
    return httpx.post(server.base_url + path, json=payload, timeout=60)


def body_for(path: str, **fields) -> dict:
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    return {**base, "max_tokens": 2, **fields}


REFUSED = [  # (path, field, value, the param the 400 names)
    (CHAT, "tool_choice", "auto", "tool_choice"),  # without tools
    (CHAT, "functions", [{"name": "f", "parameters": {}}], "functions"),
    (CHAT, "function_call", "auto", "function_call"),
    (CHAT, "echo", True, "echo"),  # vLLM's chat echo: not implemented
    (COMPLETIONS, "frobnicate", 1, "frobnicate"),
    (CHAT, "stream_options", {"continuous_usage_stats": True}, "stream_options"),
]


@pytest.mark.parametrize("path,field,value,param", REFUSED,
                         ids=[f"{p.split('/')[-1]}-{f}" for p, f, _, _ in REFUSED])
def test_fields_not_implemented_are_400s_naming_them(server, path, field, value, param):
    response = post(server, path, body_for(path, **{field: value}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and field in error["message"], error
    assert error["type"] == "BadRequestError"


ACCEPTED = [
    (CHAT, {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
            "user": "u-1", "metadata": {"run": "7"}, "store": False, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "s", "seed": 4, "logprobs": True,
            "top_logprobs": 2, "min_tokens": 1, "max_completion_tokens": 3,
            "functions": None, "function_call": None}),
    (COMPLETIONS, {"echo": True, "user": "u-1", "seed": 4, "logprobs": 1, "min_tokens": 1,
                   "response_format": {"type": "text"}, "best_of": 1, "top_k": 5,
                   "min_p": 0.1, "repetition_penalty": 1.1, "stop_token_ids": [3]}),
]


@pytest.mark.parametrize("path,fields", ACCEPTED, ids=["chat", "completions"])
def test_implemented_and_harmless_fields_pass(server, path, fields):
    response = post(server, path, body_for(path, **fields))
    assert response.status_code == 200, response.text


def test_what_vllm_bench_serve_sends(server):
    """Its openai (completions) and openai-chat backends' bodies, streaming with usage."""
    bodies = [(COMPLETIONS, {"model": "tiny", "prompt": "hi", "repetition_penalty": 1.0,
                             "max_tokens": 3, "logprobs": None, "stream": True,
                             "stream_options": {"include_usage": True}, "ignore_eos": True,
                             "temperature": 0.0, "top_p": 1.0}),
              (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [
                  {"type": "text", "text": "hi"}]}], "max_completion_tokens": 3,
                      "stream": True, "stream_options": {"include_usage": True},
                      "ignore_eos": True})]
    for path, body in bodies:
        with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as response:
            assert response.status_code == 200
            text = "".join(response.iter_text())
        assert '"completion_tokens":3' in text.replace(" ", "") and "[DONE]" in text


def test_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0.7, seed=1, user="u",
        logprobs=True, top_logprobs=2, stop=["\n\n"], presence_penalty=0.1,
        frequency_penalty=0.1, logit_bias={"5": -1}, n=2, metadata={"a": "b"}, store=False)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens <= 8
    streamed = client.completions.create(
        model="tiny", prompt="Once", max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, echo=False, logprobs=1, user="u",
        extra_body={"top_k": 3, "ignore_eos": True, "vllm_xargs": {"ban_tokens": [5]}})
    assert [c.usage.completion_tokens for c in streamed if c.usage] == [4]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice="auto")
    assert refused.value.body["param"] == "tool_choice"


def test_vllm_xargs_reach_the_processor_for_those_requests_only(server):
    """Three requests in one batch; the middle one bans every token but " x"."""
    prompts = ["The quick brown fox", "Once upon a time", "def main():"]
    alone = [post(server, COMPLETIONS, {"prompt": p, **GREEDY}).json()["choices"][0]["text"]
             for p in prompts]
    allowed = post(server, "/tokenize", {"prompt": " x", "add_special_tokens": False}).json()
    assert len(allowed["tokens"]) == 1
    ban = [t for t in range(tiny_config().vocab_size) if t != allowed["tokens"][0]]

    async def together():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.gather(*(client.post(COMPLETIONS, json={
                "prompt": p, **GREEDY, **({"vllm_xargs": {"ban_tokens": ban}} if i == 1 else {})})
                for i, p in enumerate(prompts)))

    batched = [r.json()["choices"][0]["text"] for r in asyncio.run(together())]
    assert batched == [alone[0], " x" * GREEDY["max_tokens"], alone[2]]
    refused = post(server, COMPLETIONS, {"prompt": "x", "vllm_xargs": {"ban_tokens": "all"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "vllm_xargs"
