"""Bad input: schemathesis against the server's own OpenAPI schema for the OpenAI routes, plus a
hand-written table of nasty requests (tests/test_server_errors.py holds the ordinary 400 table).
The rule for both: never a 5xx, and every error is an OpenAI-style body with a useful message.

The schema comes from the app itself (no model needed); requests go to a tiny-model server on
loopback. Examples per operation: FUZZ_EXAMPLES, the same ones every run (default suite), and
SOAK_FUZZ_EXAMPLES fresh random ones under `-m soak`.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine_config import EngineConfig
from kvserve.entrypoints.openai.server import ServerConfig, build_app
from kvserve.testing.server import ServerProcess
from tests.helpers import assert_idle, tiny_server_flags

FUZZ_EXAMPLES = 10
SOAK_FUZZ_EXAMPLES = 1000
OPENAI_ROUTES = r"^/(v1/|tokenize|detokenize)"
# Each example must stay cheap: valid `n`, output lengths and prompt-list sizes are capped
# before sending (a missing max_tokens becomes the cap); their limits are in the hand-written
# table. Invalid values are sent as generated.
MAX_FUZZ_N = 2
MAX_FUZZ_PROMPTS = 4
MAX_FUZZ_TOKENS = 4
TRIED = {"examples": 0, "4xx": 0}


def _schema():
    app = build_app(AsyncEngine(EngineConfig(model="unused")), ServerConfig())
    schema = schemathesis.openapi.from_dict(app.openapi()).include(path_regex=OPENAI_ROUTES)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema


schema = _schema()


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz-server") / "server.log"
    # a short context keeps every schema-valid request cheap on the tiny model
    flags = tiny_server_flags(tiny_model_dir, kv_blocks=512, max_model_len=48)
    with ServerProcess(flags, log_path=log) as process:
        yield process
    assert process.exit_code == 0


@pytest.fixture(scope="module", autouse=True)
def report_examples():
    yield
    print("\nschemathesis examples:", TRIED)


def assert_openai_error_or_success(response, path: str = "") -> None:
    """Below 500, and an error in the route's API's shape: Anthropic's for /v1/messages
    ({"type": "error", "error": {"type", "message"}}), OpenAI's elsewhere."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        assert isinstance(error["message"], str) and len(error["message"]) > 3, error
        if path.startswith("/v1/messages"):
            assert body.get("type") == "error" and error["type"].endswith("_error"), body
        else:
            assert error["type"] and error["code"], error


def _bounded(body):
    if isinstance(body, dict):
        for key, cap in (("n", MAX_FUZZ_N), ("max_tokens", MAX_FUZZ_TOKENS),
                         ("max_completion_tokens", MAX_FUZZ_TOKENS)):
            if isinstance(body.get(key), int) and body[key] > cap:
                body[key] = cap
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_FUZZ_TOKENS
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            body["prompt"] = prompt[:MAX_FUZZ_PROMPTS]
    return body


def _fuzz(case, server) -> None:
    case.body = _bounded(case.body)
    response = case.call(base_url=server.base_url, timeout=120)
    TRIED["examples"] += 1
    TRIED["4xx"] += 400 <= response.status_code < 500
    assert_openai_error_or_success(response, case.path)


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_schemathesis(case, fuzz_server):
    _fuzz(case, fuzz_server)


@pytest.mark.soak
@schema.parametrize()
@settings(max_examples=SOAK_FUZZ_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_schemathesis_soak(case, fuzz_server):
    _fuzz(case, fuzz_server)


# ---- the hand-written table --------------------------------------------------------------
def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = '"messages": [{"role": "user", "content": "hi"}]'

NASTY = [
    # (id, path, raw JSON body)
    ("json-array-body", COMPLETIONS, "[1, 2, 3]"),
    ("json-null-body", COMPLETIONS, "null"),
    ("json-string-body", CHAT, '"hello"'),
    ("deeply-nested-prompt", COMPLETIONS, '{"prompt": %s}' % _nested(100_000)),
    ("deeply-nested-content", CHAT,
     '{"messages": [{"role": "user", "content": %s}]}' % _nested(5_000)),
    ("nested-object-content", CHAT,
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": {"b": 1}}}]}]}'),
    ("image-part", CHAT, '{"messages": [{"role": "user", "content": '
     '[{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}'),
    ("nan-temperature", COMPLETIONS, '{"prompt": "x", "temperature": NaN}'),
    ("infinite-top-p", COMPLETIONS, '{"prompt": "x", "top_p": Infinity}'),
    ("huge-max-tokens", COMPLETIONS, '{"prompt": "x", "max_tokens": %d}' % 10**100),
    ("huge-seed", COMPLETIONS, '{"prompt": "x", "seed": %d}' % 2**64),
    ("huge-stop-token-id", COMPLETIONS, '{"prompt": "x", "stop_token_ids": [%d]}' % 2**70),
    ("huge-logit-bias-id", COMPLETIONS, '{"prompt": "x", "logit_bias": {"%d": 1}}' % 2**70),
    ("negative-logit-bias-id", COMPLETIONS, '{"prompt": "x", "logit_bias": {"-1": 1}}'),
    ("logit-bias-value", COMPLETIONS, '{"prompt": "x", "logit_bias": {"5": 1e9}}'),
    ("nested-token-out-of-vocab", COMPLETIONS, '{"prompt": [[5, 6], [7, 1000000000]]}'),
    ("negative-token", COMPLETIONS, '{"prompt": [5, -1]}'),
    ("mixed-prompt-list", COMPLETIONS, '{"prompt": [5, "a", [1]]}'),
    ("empty-inner-prompt", COMPLETIONS, '{"prompt": [[1, 2], []]}'),
    ("too-many-stops", COMPLETIONS, '{"prompt": "x", "stop": %s}' % json.dumps(["s"] * 65)),
    ("empty-stop", CHAT, '{%s, "stop": [""]}' % USER),
    ("n-too-large", CHAT, '{%s, "n": 129}' % USER),
    ("max-tokens-zero", CHAT, '{%s, "max_tokens": 0}' % USER),
    ("max-tokens-beyond-context", CHAT, '{%s, "max_tokens": 48}' % USER),
    ("huge-prompt", COMPLETIONS, json.dumps({"prompt": "lorem ipsum " * 100_000})),
    ("template-kwargs-clash", CHAT, '{%s, "chat_template_kwargs": {"add_generation_prompt": 1}}'
     % USER),
    ("template-kwargs-messages", CHAT, '{%s, "chat_template_kwargs": {"messages": 5}}' % USER),
    ("template-kwargs-template", CHAT, '{%s, "chat_template_kwargs": {"chat_template": '
     '"{%% for i in range(99999) %%}{%% for j in range(99999) %%}x{%% endfor %%}{%% endfor %%}"}}'
     % USER),
    ("unknown-role", CHAT, '{"messages": [{"role": "root", "content": "hi"}]}'),
    ("role-not-string", CHAT, '{"messages": [{"role": ["user"], "content": "hi"}]}'),
    ("message-not-object", CHAT, '{"messages": [42]}'),
    ("tokenize-neither", "/tokenize", "{}"),
    ("lone-surrogate-prompt", COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("lone-surrogate-chat", CHAT,
     '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
    ("lone-surrogate-stop", COMPLETIONS, '{"prompt": "x", "max_tokens": 2, "stop": ["\\ud83d"]}'),
    ("lone-surrogate-key", COMPLETIONS, '{"prompt": "x", "\\ud800": 1}'),
    ("surrogate-tokenize", "/tokenize", '{"prompt": "\\ud800"}'),
    ("detokenize-huge", "/detokenize", '{"tokens": [%d]}' % 2**70),
    ("detokenize-strings", "/detokenize", '{"tokens": ["a"]}'),
]

# bodies a server may accept (2xx) or reject (4xx), but never fail on
ACCEPTABLE = [
    ("huge-priority", COMPLETIONS, '{"prompt": "x", "max_tokens": 2, "priority": %d}' % 2**70),
    ("huge-top-k", COMPLETIONS, '{"prompt": "x", "max_tokens": 2, "top_k": %d}' % 2**70),
    ("nul-bytes", COMPLETIONS, '{"prompt": "a\\u0000b", "max_tokens": 2}'),
    ("tiny-top-p", COMPLETIONS, '{"prompt": "x", "top_p": 1e-300, "max_tokens": 2}'),
    ("tiny-temperature", COMPLETIONS, '{"prompt": "x", "temperature": 1e-300, "max_tokens": 2}'),
    ("many-prompts", COMPLETIONS, json.dumps({"prompt": [[5]] * 64, "max_tokens": 1})),
    ("special-token-text", COMPLETIONS,
     '{"prompt": "<|im_end|><|endoftext|>", "max_tokens": 2, "skip_special_tokens": false}'),
    ("logprobs-on-all", CHAT, '{%s, "logprobs": true, "top_logprobs": 20, "n": 3, '
     '"max_tokens": 3}' % USER),
]


def _post(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.base_url + path, content=body.encode("utf-8", "surrogatepass"),
                      headers={"Content-Type": "application/json"}, timeout=120)


@pytest.mark.parametrize("path,body", [pytest.param(p, b, id=i) for i, p, b in NASTY])
def test_nasty_requests_get_4xx(fuzz_server, path, body):
    response = _post(fuzz_server, path, body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert_openai_error_or_success(response)


@pytest.mark.parametrize("path,body", [pytest.param(p, b, id=i) for i, p, b in ACCEPTABLE])
def test_odd_but_legal_requests_never_5xx(fuzz_server, path, body):
    assert_openai_error_or_success(_post(fuzz_server, path, body))


def test_server_is_idle_and_serving_after_the_fuzzing(fuzz_server):
    assert_idle(fuzz_server.base_url, timeout=60)
    response = httpx.post(fuzz_server.base_url + COMPLETIONS,
                          json={"prompt": "ok", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
