"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): the translation into a
chat request, the 400s for what is not implemented, content blocks whole and streamed; then
end to end through the official `anthropic` client against a real `kvserve serve` on the tiny
random model: greedy text equal to /v1/chat/completions', stop sequences and max_tokens, the
stream's events in Anthropic's order adding up to the whole message, a forced tool call whose
input follows its schema and its result sent back, token counts, x-api-key auth, and errors in
Anthropic's shape (before a stream and in the middle of one)."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter, ValidationError

from kvserve.entrypoints.openai.anthropic.blocks import ContentBlocks
from kvserve.entrypoints.openai.anthropic.errors import validation_message
from kvserve.entrypoints.openai.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvserve.entrypoints.openai.tools.formats import HERMES
from kvserve.errors import InvalidRequestError
from kvserve.plugins import ENV_VAR as PLUGINS_ENV_VAR
from kvserve.testing import faults
from kvserve.testing.server import ServerProcess
from tests.helpers import tiny_server_flags

KEY = "s3cret-key"
MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 1000},
    "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["a", "b"], "additionalProperties": False}
ADD = {"name": "add", "description": "Add two integers", "input_schema": SCHEMA}
CALL_TEXT = (' Sure. \n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
             '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>')
EVENTS = TypeAdapter(RawMessageStreamEvent)
GREEDY = {"temperature": 0}  # the SDK's create() has no temperature argument: the body's


def _request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": MODEL, "max_tokens": 8,
                                           "messages": [{"role": "user", "content": "hi"}],
                                           **fields})


# ---- translation -------------------------------------------------------------------------
def test_the_conversation_becomes_the_chat_conversation():
    request = _request(
        system=[{"type": "text", "text": "You add.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "2+3?"},
                                         {"type": "text", "text": "Use the tool."}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me add."},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "overflow"}]},
                {"type": "text", "text": "Thanks."}]}],
        tools=[ADD], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"], temperature=0.5, top_p=0.9, top_k=5,
        metadata={"user_id": "u-1"})
    chat = request.chat_request()
    assert [m.as_template_message() for m in chat.messages] == [
        {"role": "system", "content": "You add.\nBe brief."},
        {"role": "user", "content": "2+3?\nUse the tool."},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: overflow"},
        {"role": "user", "content": "Thanks."}]
    assert chat.offered_tools() == [{"type": "function", "function": {
        "name": "add", "description": "Add two integers", "parameters": SCHEMA}}]
    assert chat.effective_tool_choice() == "required" and chat.parallel_tool_calls is False
    assert (chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.user) == (
        ["\n\n"], 0.5, 0.9, 5, "u-1")
    assert chat.requested_max_tokens() == 8


@pytest.mark.parametrize("choice,chat_choice", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}})])
def test_tool_choices_map_onto_chats(choice, chat_choice):
    assert _request(tools=[ADD], tool_choice=choice).chat_request().effective_tool_choice() \
        == chat_choice


def test_output_format_is_the_chat_paths_json_schema():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    chat = CountTokensRequest.model_validate({
        "model": MODEL, "messages": [{"role": "user", "content": "n?"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}}}).chat_request()
    assert json.loads(chat.structured_spec().json) == schema


@pytest.mark.parametrize("fields,named", [
    ({"frobnicate": 1}, "frobnicate: unrecognized"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "messages.0.content: content blocks of type 'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "document"}]}]}]},
     "messages.0.content.0.tool_result.content: content blocks of type 'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "tint": 1}]}]},
     "messages.0.content.0.text.tint: unrecognized"),
    ({"system": [{"type": "image"}]}, "system: content blocks of type 'image'"),
    ({"thinking": {"type": "between_tools"}}, "thinking.type"),
    ({"thinking": {"type": "enabled"}}, 'budget_tokens is needed with type "enabled"'),
    ({"thinking": {"type": "enabled", "budget_tokens": 8}},
     "thinking.budget_tokens (8) must be less than max_tokens (8)"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}},
     'thinking.display: display "omitted" is not supported'),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"tools": [{**ADD, "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "sub"}}, "'sub'"),
    ({"tools": [ADD], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"output_config": {"effort": "max"}}, "output_config.effort"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "add", "input": {},
         "caller": {"type": "code_execution_20250825", "tool_id": "x"}}]}]},
     "messages.1.content.0.tool_use.caller"),
])
def test_what_is_not_implemented_is_a_400_naming_it(fields, named):
    with pytest.raises(ValidationError) as caught:
        _request(**fields)
    message = validation_message(caught.value.errors())
    assert named in message, message


def test_values_that_ask_for_nothing_are_accepted():
    _request(thinking={"type": "disabled"}, mcp_servers=[], service_tier="standard_only",
             metadata={"user_id": "u"}, cache_control={"type": "ephemeral"}, speed="standard",
             tools=[{**ADD, "type": "custom", "strict": True}])
    # an answer's blocks sent back as the client's models dump them
    _request(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Adding.", "citations": None},
            {"type": "tool_use", "id": "t", "name": "add", "input": {}, "caller": None,
             "toolset_name": None}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "5", "toolset_name": None}]}])


@pytest.mark.parametrize("messages,named", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}],
     "messages.1: a conversation ending with an assistant message"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "add",
                                    "input": {}}]}],
     "messages.0.content.0: tool_use blocks go in assistant messages"),
])
def test_a_conversation_the_chat_path_cannot_render_is_refused(messages, named):
    with pytest.raises(InvalidRequestError) as caught:
        _request(messages=messages).chat_request()
    assert str(caught.value).startswith(named) and caught.value.param == "messages"


# ---- content blocks ------------------------------------------------------------------------
def _fed(text: str, tool_format, step: int = 1) -> tuple[list[dict], list[dict]]:
    """(events, blocks) for `text` fed `step` characters at a time, each event parsed by the
    client's own event models."""
    blocks = ContentBlocks(tool_format)
    events = []
    for end in range(step, len(text) + step, step):
        events += blocks.feed(text[:end], end >= len(text))
    events += blocks.close()
    for event in events:
        EVENTS.validate_python(event)
    return events, blocks.blocks


def _without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in block.items() if k != "id"} for block in blocks]


@pytest.mark.parametrize("text,tool_format", [(CALL_TEXT, HERMES), (" Just text. ", HERMES),
                                              ("Plain <tool_call> text ", None)])
def test_streamed_blocks_equal_the_whole_answer(text, tool_format):
    whole = ContentBlocks(tool_format).whole(text)
    for step in (1, 7):
        events, blocks = _fed(text, tool_format, step)
        assert _without_ids(blocks) == _without_ids(whole)
        texts = "".join(e["delta"]["text"] for e in events
                        if e["type"] == "content_block_delta" and e["delta"]["type"] ==
                        "text_delta")
        assert texts == "".join(b.get("text", "") for b in whole)


def test_calls_become_tool_use_blocks_streamed_as_input_json():
    events, blocks = _fed(CALL_TEXT, HERMES)
    assert _without_ids(blocks) == [
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "name": "add", "input": {"a": 2, "b": 3}},
        {"type": "tool_use", "name": "add", "input": {"a": 1, "b": 1}}]
    assert all(b["id"].startswith("toolu_") for b in blocks[1:])
    kinds = [e["type"] for e in events]
    runs = [k for i, k in enumerate(kinds) if not (i and kinds[i - 1] == k == "content_block_delta")]
    assert runs == ["content_block_start", "content_block_delta", "content_block_stop"] * 3
    pieces = [e["delta"]["partial_json"] for e in events if e.get("index") == 1
              and e["type"] == "content_block_delta"]
    assert len(pieces) > 2 and json.loads("".join(pieces)) == {"a": 2, "b": 3}
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]


HARMONY_TURN = ("<|channel|>analysis<|message|>Need the sum.<|end|><|start|>assistant"
                "<|channel|>commentary<|message|>Adding.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
                '{"a": 2, "b": 3}<|call|>')


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("show_thinking", [True, False])
def test_a_harmony_turn_is_its_thinking_text_and_calls(whole, show_thinking):
    """Fed as the model writes it: a marker (one special token) at once, text a character
    at a time. The analysis channel is a thinking block, unless thinking was disabled."""
    pieces = [HARMONY_TURN] if whole else [
        piece for part in re.split(r"(<\|[a-z]+\|>)", HARMONY_TURN) if part
        for piece in ([part] if part.startswith("<|") else part)]
    blocks = ContentBlocks(harmony=True, show_thinking=show_thinking)
    for end in range(1, len(pieces) + 1):
        blocks.feed("".join(pieces[:end]), end == len(pieces))
    blocks.close()
    thinking = [{"type": "thinking", "thinking": "Need the sum.", "signature": ""}]
    assert _without_ids(blocks.blocks) == thinking * show_thinking + [
        {"type": "text", "text": "Adding."},
        {"type": "tool_use", "name": "add", "input": {"a": 2, "b": 3}}]


def test_a_call_cut_off_keeps_its_name_with_no_input():
    blocks = ContentBlocks(HERMES).whole(CALL_TEXT[:CALL_TEXT.index('"b": 3')])
    assert _without_ids(blocks) == [{"type": "text", "text": "Sure."},
                                    {"type": "tool_use", "name": "add", "input": {}}]
    assert ContentBlocks(None).whole("") == []


# ---- end to end on the tiny model ---------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("anthropic-server") / "server.log"
    flags = tiny_server_flags(tiny_model_dir, "--api-key", KEY, "--served-model-name", MODEL)
    with ServerProcess(flags, log_path=log, env={PLUGINS_ENV_VAR: faults.PLUGIN}) as process:
        yield process
    assert process.exit_code == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def _chat(server, messages: list[dict], **fields) -> dict:
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": MODEL, "messages": messages, "temperature": 0,
                                **fields})  # (a server without --api-key ignores the key)
    assert response.status_code == 200, response.text
    return response.json()


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


ASK = [{"role": "user", "content": "Name three colours."}]
SYSTEM = "You are terse."


def test_greedy_text_equals_chat_completions(client, server):
    message = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=ASK,
                                     extra_body=GREEDY)
    chat = _chat(server, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=12)
    choice = chat["choices"][0]
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice["message"]["content"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        choice["finish_reason"]]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert _prompt_tokens(message.usage) == chat["usage"]["prompt_tokens"]


def test_max_tokens_and_stop_sequences(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "List the planets."}],
                extra_body=GREEDY)
    long = client.messages.create(max_tokens=24, **args)
    text = long.content[0].text
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 24, long
    short = client.messages.create(max_tokens=3, **args)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert text.startswith(short.content[0].text)
    sequence = " " + text.split()[-1]  # the last word, where it first comes
    before = text[:text.index(sequence)]
    assert before, text  # (the test means something only when text comes before it)
    stopped = client.messages.create(max_tokens=24, stop_sequences=["@@never@@", sequence],
                                     **args)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == sequence
    assert [block.text for block in stopped.content] == [before]
    assert stopped.usage.output_tokens < 24


def _raw_events(server, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", server.base_url + "/v1/messages", timeout=120,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = response.read().decode().strip().split("\n\n")
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append((event["type"], event))
    return events


def test_a_stream_comes_in_anthropics_order_and_adds_up_to_the_message(client, server):
    args = dict(model=MODEL, max_tokens=16, system=SYSTEM, messages=ASK)
    whole = client.messages.create(**args, extra_body=GREEDY)
    events = _raw_events(server, {**args, **GREEDY})
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    for _, event in events:
        if event["type"] != "ping":
            EVENTS.validate_python(event)
    assert events[-2][1]["delta"]["stop_reason"] == whole.stop_reason
    with client.messages.stream(**args, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert "".join(texts) == streamed.content[0].text == whole.content[0].text
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason,
                                                              whole.stop_sequence)
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_tokens(streamed.usage) == _prompt_tokens(whole.usage)
    assert streamed.usage.cache_read_input_tokens > 0  # the same prompt: a prefix-cache hit
    assert streamed.id != whole.id


TOOL_ASK = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]


@pytest.fixture(scope="module")
def smol_client(smol_server):
    """The real model: the tiny random one pads a call's JSON with whitespace until
    max_tokens (the tools' structural tag leaves whitespace runs unbounded)."""
    return anthropic.Anthropic(base_url=smol_server.base_url, api_key="unused", max_retries=0)


@pytest.mark.slow
def test_a_forced_tool_call_then_its_result(smol_client, smol_server):
    args = dict(model="smol", max_tokens=64, messages=TOOL_ASK, tools=[ADD],
                tool_choice={"type": "tool", "name": "add"}, extra_body=GREEDY)
    first = smol_client.messages.create(**args)
    calls = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(calls) == 1, first
    call = calls[0]
    assert call.name == "add" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMA)
    with smol_client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [("tool_use", "add", call.input)]
    assert streamed.stop_reason == "tool_use"

    answered = [*TOOL_ASK, {"role": "assistant", "content": [b.model_dump() for b in
                                                            first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "5"}]}]
    second = smol_client.messages.create(model="smol", max_tokens=12, messages=answered,
                                         tools=[ADD], extra_body=GREEDY)
    text = "".join(block.text for block in first.content if block.type == "text")
    chat = _chat(smol_server, [*TOOL_ASK, {"role": "assistant", "content": text, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": "add", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}],
        model="smol", max_tokens=12, tools=[{"type": "function", "function": {
            "name": "add", "description": ADD["description"], "parameters": SCHEMA}}])
    assert _prompt_tokens(second.usage) == chat["usage"]["prompt_tokens"]
    assert _prompt_tokens(second.usage) > _prompt_tokens(first.usage) + first.usage.output_tokens
    assert second.usage.output_tokens == chat["usage"]["completion_tokens"]
    second_text = "".join(b.text for b in second.content if b.type == "text")
    assert second_text == (chat["choices"][0]["message"]["content"] or "")
    counted = smol_client.messages.count_tokens(model="smol", messages=answered, tools=[ADD])
    assert counted.input_tokens == _prompt_tokens(second.usage)


def test_count_tokens_is_the_rendered_prompt_tools_included(client, server):
    plain = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    chat = _chat(server, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=1)
    assert plain.input_tokens == chat["usage"]["prompt_tokens"]
    with_tools = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK,
                                              tools=[ADD])
    tool_chat = _chat(server, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=1,
                      tools=[{"type": "function", "function": {
                          "name": "add", "description": ADD["description"],
                          "parameters": SCHEMA}}], tool_choice="none")
    assert with_tools.input_tokens > plain.input_tokens + len(json.dumps(SCHEMA)) // 8
    assert tool_chat["usage"]["prompt_tokens"] == plain.input_tokens  # "none": no tools


def test_an_api_key_comes_as_x_api_key_or_bearer(server):
    only_x = {"x-api-key": KEY, "Authorization": anthropic.Omit()}
    good = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0,
                               default_headers=only_x)
    assert good.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0,
                                default_headers={**only_x, "x-api-key": "wrong"})
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0
                            ).messages.count_tokens(model=MODEL, messages=ASK)
    models = server.base_url + "/v1/models"  # the OpenAI routes: x-api-key too, their shape
    assert httpx.get(models, headers={"x-api-key": KEY}).status_code == 200
    refused = httpx.get(models, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("fields,named", [
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]},
     "messages.0.content: content blocks of type 'image'"),
    ({"thinking": {"type": "adaptive"}}, "thinking ({\"type\": \"adaptive\"}) needs a server "
     "started with --reasoning-parser"),
    ({"tools": [ADD], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
     "output_config.format"),
])
def test_bad_requests_are_anthropic_400s_naming_the_field(client, fields, named):
    args = {"model": MODEL, "max_tokens": 4, "messages": ASK, **fields}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**args)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert named in body["error"]["message"], body


def test_another_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="another-model", max_tokens=4, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "another-model" in caught.value.body["error"]["message"]


def test_an_engine_failure_is_an_api_error_whole_or_mid_stream(client, server):
    poisoned = [{"role": "user", "content": "kvserve-fault:execute hello"}]
    with pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.create(model=MODEL, max_tokens=8, messages=poisoned)
    assert caught.value.status_code == 500
    assert caught.value.body["error"]["type"] == "api_error"
    assert "InjectedFault" in caught.value.body["error"]["message"]
    events = _raw_events(server, {"model": MODEL, "max_tokens": 8, "messages": poisoned})
    assert [kind for kind, _ in events] == ["message_start", "error"]
    assert events[-1][1]["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model=MODEL, max_tokens=8, messages=poisoned) as stream:
            stream.get_final_message()
    assert caught.value.body["error"]["type"] == "api_error"
    assert client.messages.create(model=MODEL, max_tokens=2, messages=ASK).content
