"""Server edges on the tiny model: every bad request is a 4xx with an OpenAI-style body, the
server keeps serving, and the auxiliary routes work."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.testing.server import ServerProcess


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tiny-server") / "server.log"
    flags = ["--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "128",
             "--max-model-len", "512", "--max-request-body-bytes", "200000"]
    with ServerProcess(flags, log_path=log) as process:
        yield process
    assert process.exit_code == 0


def post(server, path, payload=None, content=None, headers=None):
    return httpx.post(server.base_url + path, json=payload, content=content, headers=headers,
                      timeout=30)


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens"),
    ({"prompt": "word " * 600}, "prompt"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "stop": ["s"] * 100}, "stop"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
]


@pytest.mark.parametrize("payload,param", BAD_COMPLETIONS)
def test_bad_completion_requests_get_400(tiny_server, payload, param):
    response = post(tiny_server, "/v1/completions", payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "BadRequestError"
    assert error["param"] == param


def test_context_length_error_has_its_code(tiny_server):
    error = post(tiny_server, "/v1/completions", {"prompt": "x", "max_tokens": 600}).json()
    assert error["error"]["code"] == "context_length_exceeded"


BAD_CHATS = [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": "hello"},
    {"messages": [{"role": "user", "content": {"nested": {"deep": [1, 2]}}}]},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
]


@pytest.mark.parametrize("payload", BAD_CHATS)
def test_bad_chat_requests_get_400(tiny_server, payload):
    response = post(tiny_server, "/v1/chat/completions", payload)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_invalid_json_and_utf8(tiny_server):
    for body in (b"{not json", b'{"prompt": "\xff\xfe"}', b""):
        response = post(tiny_server, "/v1/completions", content=body,
                        headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert "error" in response.json()


def test_unknown_model_is_404(tiny_server):
    response = post(tiny_server, "/v1/completions", {"prompt": "x", "model": "gpt-5"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_oversized_body_is_413(tiny_server):
    response = post(tiny_server, "/v1/completions", {"prompt": "x" * 300_000})
    assert response.status_code == 413


def test_still_serving_after_errors(tiny_server):
    response = post(tiny_server, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_auxiliary_routes(tiny_server):
    base = tiny_server.base_url
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/version").json()["version"]
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == 512
    tokens = post(tiny_server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2
    text = post(tiny_server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat_tokens = post(tiny_server, "/tokenize",
                       {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tokens["tokens"][0] == 1
    assert post(tiny_server, "/detokenize", {"tokens": [10**8]}).status_code == 400


def test_echo_and_token_prompts(tiny_server):
    body = post(tiny_server, "/v1/completions", {"prompt": ["abc", "def ghi"], "max_tokens": 2,
                                                "echo": True, "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"].startswith("abc")
    assert body["choices"][3]["text"].startswith("def ghi")
    by_ids = post(tiny_server, "/v1/completions", {"prompt": [[1, 2, 3], [4, 5]],
                                                  "max_tokens": 2}).json()
    assert by_ids["usage"]["prompt_tokens"] == 3 + 2 and len(by_ids["choices"]) == 2


@pytest.fixture(scope="module")
def locked_server(tiny_model_dir):
    flags = ["--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64",
             "--api-key", "s3cret", "--max-waiting-requests", "0"]
    with ServerProcess(flags) as process:
        yield process


def test_api_key_required_everywhere_but_health(locked_server):
    base = locked_server.base_url
    assert httpx.get(base + "/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/version"),
                         ("POST", "/v1/completions"), ("POST", "/tokenize")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.request(method, base + path, headers=headers, json={"prompt": "x"})
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    good = {"Authorization": "Bearer s3cret"}
    assert httpx.get(base + "/v1/models", headers=good).status_code == 200


def test_queue_limit_gives_503(locked_server):
    response = httpx.post(locked_server.base_url + "/v1/completions",
                          headers={"Authorization": "Bearer s3cret"}, json={"prompt": "x"})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "overloaded"


def _stream(server, path: str, payload: dict) -> list[dict]:
    with httpx.stream("POST", server.base_url + path, json={**payload, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines()
                 if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _counts(usage: dict) -> dict:
    """Usage without the cached-token details (a repeated prompt hits the prefix cache)."""
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def test_streamed_completions_add_up_to_the_whole_response(tiny_server):
    """Streams are built from the engine's deltas: echo, text, logprobs with their offsets, the
    stop string and usage add up to what the same request returns whole."""
    payload = {"prompt": ["abc", "def ghi"], "max_tokens": 10, "echo": True, "n": 2, "seed": 5,
               "temperature": 0.9, "logprobs": 1}
    whole = post(tiny_server, "/v1/completions", payload).json()
    payload["stop"] = [whole["choices"][1]["text"][len("abc") + 3:][:2]]
    whole = post(tiny_server, "/v1/completions", payload).json()
    chunks = _stream(tiny_server, "/v1/completions",
                     {**payload, "stream_options": {"include_usage": True}})
    assert _counts(chunks[-1]["usage"]) == _counts(whole["usage"])
    for choice in whole["choices"]:
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        for key in ("tokens", "text_offset"):
            assert [v for c in mine if c["logprobs"] for v in c["logprobs"][key]] == \
                choice["logprobs"][key]
        # the same tokens, their logprobs from another batch's float sums
        assert [v for c in mine if c["logprobs"] for v in c["logprobs"]["token_logprobs"]] == \
            pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)
    assert whole["choices"][1]["finish_reason"] == "stop"


def test_streamed_chat_logprobs_and_usage_match_the_whole_response(tiny_server):
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
               "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = post(tiny_server, "/v1/chat/completions", payload).json()
    chunks = _stream(tiny_server, "/v1/chat/completions",
                     {**payload, "stream_options": {"include_usage": True}})
    assert _counts(chunks[-1]["usage"]) == _counts(whole["usage"])
    deltas = [c for chunk in chunks for c in chunk["choices"]]
    assert "".join(c["delta"].get("content", "") for c in deltas) == \
        whole["choices"][0]["message"]["content"]
    streamed = [e for c in deltas if c["logprobs"] for e in c["logprobs"]["content"]]
    expected = whole["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in expected]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in expected],
                                                             abs=1e-4)
