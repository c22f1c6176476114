"""Thinking on Anthropic's Messages API: `thinking` mapped onto the chat path (the template's
enable_thinking, the thinking budget), earlier answers' thinking blocks sent back, and a
thinking model's reply as a thinking block before its text or tool_use blocks, whole and
streamed (thinking_delta, one signature_delta, content_block_stop, the text at the next index),
the tag split across tokens never leaking. End to end through the official `anthropic` client
on the tiny random model with Qwen3's chat template and --reasoning-parser qwen3, its replies
written by ForceTokens (tests/test_anthropic.py covers the 400 without a parser)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from kvserve.entrypoints.openai.anthropic.blocks import ContentBlocks
from kvserve.entrypoints.openai.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvserve.entrypoints.openai.reasoning.parser import ThinkingPlan
from kvserve.entrypoints.openai.tools.formats import HERMES
from kvserve.errors import InvalidRequestError
from kvserve.testing.server import ServerProcess
from tests.helpers import llama_cpp_chat_template, tiny_server_flags

MODEL = "thinker"
THOUGHT = "The user greets me, so I greet back <b>warmly</b> and offer help."
ANSWER = "Hello! How can I help you today?"
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
HELLO = [{"role": "user", "content": "Hello!"}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}
CALL_REPLY = ("<think>\nParis weather: call the tool.\n</think>\n\n<tool_call>\n"
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
EVENTS = TypeAdapter(RawMessageStreamEvent)
MAY_THINK = ThinkingPlan(inside=False)


def _request(cls=MessagesRequest, **fields):
    extra = {"max_tokens": 64} if cls is MessagesRequest else {}
    return cls.model_validate({"model": MODEL, "messages": HELLO, **extra, **fields})


# ---- translation -------------------------------------------------------------------------
@pytest.mark.parametrize("thinking,fields", [
    ({"type": "enabled", "budget_tokens": 16},
     ({"enable_thinking": True}, 16, True)),
    ({"type": "adaptive", "display": "summarized"}, ({"enable_thinking": True}, None, True)),
    ({"type": "disabled"}, ({"enable_thinking": False}, None, False)),
    (None, (None, None, True)),
])
def test_thinking_becomes_the_chat_paths_template_switch_and_budget(thinking, fields):
    for cls in (MessagesRequest, CountTokensRequest):
        chat = _request(cls, thinking=thinking).chat_request()
        assert (chat.chat_template_kwargs, chat.thinking_token_budget,
                chat.include_reasoning) == fields


def test_thinking_blocks_sent_back_are_the_turns_reasoning():
    """The tool loop's assistant turn as the client got it: its thinking becomes the turn's
    reasoning_content (the template decides what to keep); redacted thinking is dropped."""
    turn = [{"type": "thinking", "thinking": "Call it.", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]
    chat = _request(messages=[*HELLO, {"role": "assistant", "content": turn}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                     "content": "sunny"}]}], tools=[WEATHER]).chat_request()
    assistant = chat.messages[1].as_template_message()
    assert (assistant["reasoning_content"], assistant["content"]) == ("Call it.", "")
    assert [call["function"]["name"] for call in assistant["tool_calls"]] == ["get_weather"]
    with pytest.raises(InvalidRequestError, match="thinking blocks go in assistant messages"):
        _request(messages=[{"role": "user", "content": [
            {"type": "thinking", "thinking": "x", "signature": ""}]}]).chat_request()


# ---- content blocks ----------------------------------------------------------------------
def _fed_by_token(tokenizer, text: str, **options) -> tuple[list[dict], list[dict]]:
    """(events, blocks) for `text` fed as the server decodes it, a token at a time (SmolLM2's
    tokenizer writes </think> as three tokens), each event checked against the client's own
    event models."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    blocks = ContentBlocks(reasoning=MAY_THINK, **options)
    events = [event for written in range(1, len(ids) + 1)
              for event in blocks.feed(tokenizer.decode(ids[:written]), written == len(ids))]
    events += blocks.close()
    assert all(EVENTS.validate_python(event) for event in events)
    return events, blocks.blocks


def _without_ids(blocks: list[dict]) -> list[dict]:
    """Blocks to compare: a tool_use block's id is new each time."""
    return [dict(block, id=None) for block in blocks]


@pytest.mark.parametrize("text,tool_format", [(REPLY, None), (CALL_REPLY, HERMES)])
def test_thinking_streams_first_and_equals_the_whole_answer(tokenizer, text, tool_format):
    whole = ContentBlocks(tool_format, reasoning=MAY_THINK).whole(text)
    assert whole[0] == {"type": "thinking", "thinking": text[len("<think>"):text.index(
        "</think>")], "signature": ""}
    events, blocks = _fed_by_token(tokenizer, text, tool_format=tool_format)
    assert _without_ids(blocks) == _without_ids(whole)
    thinking = [e for e in events if e.get("index") == 0]
    kinds = [e["type"] if e["type"] != "content_block_delta" else e["delta"]["type"]
             for e in thinking]
    assert kinds[0] == "content_block_start" and kinds[-2:] == ["signature_delta",
                                                               "content_block_stop"]
    assert set(kinds[1:-2]) == {"thinking_delta"}
    pieces = [e["delta"]["thinking"] for e in thinking[1:-2]]
    assert len(pieces) > 5 and "".join(pieces) == whole[0]["thinking"]
    assert not any("think>" in piece or piece.endswith("</") for piece in pieces)
    assert (events[len(thinking)]["type"], events[len(thinking)]["index"]) == (
        "content_block_start", 1)


def test_disabled_thinking_sends_no_block_and_a_reply_that_never_thinks_is_text():
    assert ContentBlocks(reasoning=MAY_THINK, show_thinking=False).whole(REPLY) == [
        {"type": "text", "text": ANSWER}]
    assert ContentBlocks(reasoning=MAY_THINK).whole(f"\n {ANSWER} ") == [
        {"type": "text", "text": ANSWER}]
    # cut off while thinking: the thinking alone
    assert [b["type"] for b in ContentBlocks(reasoning=MAY_THINK).whole(REPLY[:30])] == \
        ["thinking"]


# ---- end to end --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    from kvserve.testing.tiny import write_tiny_model_dir

    directory = write_tiny_model_dir(tmp_path_factory.mktemp("thinker"), tokenizer)
    config_path = directory / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template":
                                       llama_cpp_chat_template("Qwen-Qwen3-0.6B")}))
    log = tmp_path_factory.mktemp("anthropic-thinking") / "server.log"
    flags = tiny_server_flags(directory, "--served-model-name", MODEL, "--reasoning-parser",
                              "qwen3", "--logits-processors",
                              "kvserve.testing.logits_processors:ForceTokens,"
                              "kvserve.testing.logits_processors:BanTokens")
    with ServerProcess(flags, log_path=log) as process:
        yield process
    assert "outside its grammar" not in log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _written(tokenizer, text: str, end: bool = True) -> dict:
    """The body fields that make the model write `text` (then EOS unless `end` is false, and
    then never EOS), greedily."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return {"temperature": 0, "vllm_xargs": {
        "force_tokens": ids + ([tokenizer.eos_token_id] if end else []),
        "ban_tokens": [] if end else [tokenizer.eos_token_id]}}


def _args(tokenizer, reply: str, end: bool = True, **fields) -> dict:
    return {"model": MODEL, "max_tokens": 96, "messages": HELLO,
            "extra_body": _written(tokenizer, reply, end), **fields}


def _dumped(message) -> list[dict]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def _chat(server, tokenizer, reply: str, end: bool = True, **fields) -> dict:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 96,
            **_written(tokenizer, reply, end), **fields}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_a_thinking_block_then_text_whole_and_streamed(client, server, tokenizer):
    args = _args(tokenizer, REPLY)
    whole = client.messages.create(**args)
    assert _dumped(whole) == [
        {"type": "thinking", "thinking": f"\n{THOUGHT}\n", "signature": ""},
        {"type": "text", "text": ANSWER}]
    assert whole.stop_reason == "end_turn"
    chat = _chat(server, tokenizer, REPLY)["message"]
    assert chat["reasoning_content"] == whole.content[0].thinking
    assert chat["content"].strip() == whole.content[1].text
    with client.messages.stream(**args) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert _dumped(streamed) == _dumped(whole)
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (
        whole.stop_reason, whole.usage.output_tokens)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    thinking = [d.thinking for d in deltas if d.type == "thinking_delta"]
    assert len(thinking) > 5 and "".join(thinking) == f"\n{THOUGHT}\n"
    assert [d.signature for d in deltas if d.type == "signature_delta"] == [""]
    starts = [(e.index, e.content_block.type) for e in events
              if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER


def test_the_budget_closes_the_thinking_on_time(client, server, tokenizer):
    """After <think> the random model thinks freely (never EOS): unbounded it thinks to
    max_tokens; with budget_tokens its thinking closes after that many tokens, as the chat
    path's thinking_token_budget closes it, and its answer follows as text."""
    open_only = _args(tokenizer, "<think>", end=False, max_tokens=24)
    unbounded = client.messages.create(**open_only, thinking={"type": "adaptive"})
    assert [b.type for b in unbounded.content] == ["thinking"]
    assert unbounded.stop_reason == "max_tokens"
    bounded = client.messages.create(**open_only,
                                     thinking={"type": "enabled", "budget_tokens": 6})
    assert [b.type for b in bounded.content] == ["thinking", "text"]
    assert bounded.usage.output_tokens == 24
    chat = _chat(server, tokenizer, "<think>", end=False, max_tokens=24,
                 thinking_token_budget=6)["message"]
    assert bounded.content[0].thinking == chat["reasoning_content"]
    assert bounded.content[0].thinking != unbounded.content[0].thinking
    assert unbounded.content[0].thinking.startswith(bounded.content[0].thinking)
    assert bounded.content[1].text == chat["content"].strip()
    with client.messages.stream(**open_only, thinking={"type": "enabled",
                                                       "budget_tokens": 6}) as stream:
        assert _dumped(stream.get_final_message()) == _dumped(bounded)


def test_thinking_then_a_tool_call_and_the_turn_sent_back(client, server, tokenizer):
    args = _args(tokenizer, CALL_REPLY, tools=[WEATHER],
                 thinking={"type": "enabled", "budget_tokens": 64})
    first = client.messages.create(**args)
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == "\nParis weather: call the tool.\n"
    assert (first.content[1].name, first.content[1].input) == ("get_weather", {"city": "Paris"})
    assert first.stop_reason == "tool_use"
    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert _without_ids(_dumped(streamed)) == _without_ids(_dumped(first))

    # the turn sent back as received: its thinking is the current tool loop's, which Qwen3's
    # template keeps; once a new user query follows, the template drops it
    def counted(thinking: bool, *after: dict) -> int:
        content = [b for b in _dumped(first) if thinking or b["type"] != "thinking"]
        messages = [*HELLO, {"role": "assistant", "content": content}, {
            "role": "user", "content": [{"type": "tool_result", "content": "sunny",
                                         "tool_use_id": first.content[1].id}]}, *after]
        return client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER],
                                            thinking={"type": "adaptive"}).input_tokens

    call = first.content[1]
    chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 1, "tools": [{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}],
        "messages": [*HELLO, {"role": "assistant", "content": "",
                              "reasoning_content": first.content[0].thinking,
                              "tool_calls": [{"id": call.id, "type": "function", "function": {
                                  "name": call.name, "arguments": json.dumps(call.input)}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]}).json()
    assert counted(True) == chat["usage"]["prompt_tokens"]
    assert counted(True) > counted(False) + 10  # the thinking, rendered
    later = {"role": "user", "content": "And tomorrow?"}
    assert counted(True, later) == counted(False, later)
    answered = [*HELLO, {"role": "assistant", "content": _dumped(first)}, {
        "role": "user", "content": [{"type": "tool_result", "content": "sunny",
                                     "tool_use_id": first.content[1].id}]}]
    second = client.messages.create(**_args(tokenizer, REPLY, messages=answered,
                                            tools=[WEATHER]))
    assert [b.type for b in second.content] == ["thinking", "text"]


def test_disabled_thinking_closes_it_in_the_template(client, tokenizer):
    """Qwen3's template writes an empty thinking into the prompt when enable_thinking is false:
    the prompt grows by its tokens, and the reply is all text (a model told not to think
    that writes <think> anyway is not read as thinking, vLLM's rule)."""
    def count(kind: str) -> int:
        return client.messages.count_tokens(model=MODEL, messages=HELLO,
                                            thinking={"type": kind}).input_tokens

    empty = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert count("disabled") - count("adaptive") == len(empty)
    off = client.messages.create(**_args(tokenizer, REPLY, thinking={"type": "disabled"}))
    assert _dumped(off) == [{"type": "text", "text": REPLY}]


@pytest.mark.parametrize("thinking,named", [
    ({"type": "enabled", "budget_tokens": 96}, "thinking.budget_tokens (96) must be less"),
    ({"type": "between_tools"}, "thinking.type"),
    ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
    ({"type": "disabled", "budget_tokens": 8}, "budget_tokens is needed with type"),
])
def test_bad_thinking_is_a_400_naming_it(client, tokenizer, thinking, named):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**_args(tokenizer, REPLY, thinking=thinking))
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert named in caught.value.body["error"]["message"], caught.value.body
