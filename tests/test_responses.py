"""The Responses API (/v1/responses): the translation into a chat request, the 400s for what is
not implemented, output items and streamed events checked against the `openai` package's own
models, the store; then end to end on the real model through the official client: text whole
and streamed alike, a required function call, a second turn through previous_response_id with
the call's output, store: false, text.format json_schema, and 400s naming what is refused."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from kvserve.entrypoints.openai.errors import validation_message
from kvserve.entrypoints.openai.responses.conversation import as_input_items, chat_messages
from kvserve.entrypoints.openai.responses.objects import Turn, output_items
from kvserve.entrypoints.openai.responses.protocol import ResponsesRequest
from kvserve.entrypoints.openai.responses.store import ResponseStore
from kvserve.entrypoints.openai.responses.stream import (
    EventWriter,
    OutputStream,
    response_events,
)
from kvserve.entrypoints.openai.serving import Job
from kvserve.entrypoints.openai.tools.formats import HERMES
from kvserve.errors import RequestFailedError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind

ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {
           "a": {"type": "integer", "minimum": 0, "maximum": 1000},
           "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
           "required": ["a", "b"], "additionalProperties": False}}
CALL_TEXT = ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
             '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>')
EVENTS = TypeAdapter(ResponseStreamEvent)


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def _refused(**fields) -> tuple[str, str | None]:
    """(message, param) of the 400 a body with these fields gets."""
    with pytest.raises(ValidationError) as caught:
        _request(**fields)
    return validation_message(caught.value.errors())


def _result(text: str, finish_reason: str | None = "stop") -> RequestOutput:
    sample = CompletionOutput(index=0, text=text, token_ids=[1] * 7, finish_reason=finish_reason)
    return RequestOutput("r", None, [5] * 11, [sample], finish_reason is not None,
                         num_cached_tokens=4)


# ---- translation -------------------------------------------------------------------------
def test_input_items_become_the_chat_conversation():
    request = _request(input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add",
         "arguments": '{"a": 2, "b": 3}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"}])
    messages = chat_messages("You add numbers.", request.input_items())
    assert messages == [
        {"role": "system", "content": "You add numbers."},
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    chat = request.chat_request(messages)
    assert [m.as_template_message()["role"] for m in chat.messages] == [
        "system", "system", "user", "assistant", "tool"]


def test_request_fields_map_onto_the_chat_request():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    request = _request(tools=[ADD], tool_choice={"type": "function", "name": "add"},
                       parallel_tool_calls=False, max_output_tokens=9, temperature=0.5,
                       top_p=0.9, text={"format": {"type": "json_schema", "name": "n",
                                                   "schema": schema, "strict": True}})
    chat = request.chat_request([{"role": "user", "content": "hi"}])
    assert chat.tools[0].model_dump(exclude_none=True) == {"type": "function", "function": {
        k: v for k, v in ADD.items() if k != "type"}}
    assert chat.effective_tool_choice() == {"type": "function", "function": {"name": "add"}}
    assert chat.parallel_tool_calls is False and chat.requested_max_tokens() == 9
    assert (chat.temperature, chat.top_p) == (0.5, 0.9)
    assert chat.response_format.json_schema.schema_ == schema
    assert _request(text={"format": {"type": "json_object"}}).chat_request(
        [{"role": "user", "content": "x"}]).structured_spec().json_object


def test_an_empty_conversation_is_a_400_naming_input():
    with pytest.raises(Exception) as caught:
        _request(input=[]).chat_request(chat_messages(None, []))
    assert caught.value.param == "input"


@pytest.mark.parametrize("fields,param,named", [
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"tools": [ADD, {"type": "file_search", "vector_store_ids": []}]}, "tools", "file_search"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "input_image"}]}]}, "input",
     "input_image"),
    ({"input": [{"type": "reasoning", "content": "not a list"}]}, "input", "list"),  # fuzzer
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input_image"),
    ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning", "reasoning.summary"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"tool_choice": {"type": "function", "name": "add"}}, "tool_choice", "needs tools"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "nope"),
    ({"tools": [ADD], "tool_choice": {"type": "web_search"}}, "tool_choice", "tool_choice"),
    ({"frobnicate": 1}, "frobnicate", "unrecognized"),
])
def test_what_is_not_implemented_is_a_400_naming_it(fields, param, named):
    message, refused = _refused(**fields)
    assert refused == param and named in message, message


def test_values_that_ask_for_nothing_are_accepted():
    _request(include=[], truncation="disabled", background=False, reasoning={"effort": "low"},
             store=False, metadata={"k": "v"}, user="u", prompt_cache_key="p",
             service_tier="auto")


# ---- output items, the response object, events -----------------------------------------
def _turn(**fields) -> Turn:
    request = _request(**fields)
    return Turn(request, "resp_1", "smol", 1, request.input_items())


def test_a_response_body_parses_strictly_as_the_clients_response():
    turn = _turn(tools=[ADD], instructions="be brief", metadata={"k": "v"})
    assert Response.model_validate(turn.body()).status == "in_progress"  # response.created's
    items = output_items(_result(CALL_TEXT).outputs[0], HERMES)
    body = turn.finished(items, _result(CALL_TEXT))
    response = Response.model_validate(body)
    assert response.status == "completed" and response.output_text == "Sure."
    assert [item.type for item in response.output] == ["message", "function_call",
                                                        "function_call"]
    call = response.output[1]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"a": 2, "b": 3}
    assert body["usage"] == {"input_tokens": 11, "input_tokens_details": {
                                 "cached_tokens": 4, "cache_write_tokens": 0},
                             "output_tokens": 7, "output_tokens_details": {
                                 "reasoning_tokens": 0}, "total_tokens": 18}
    assert (body["instructions"], body["metadata"], body["store"]) == ("be brief", {"k": "v"},
                                                                       True)


def test_max_output_tokens_makes_it_incomplete():
    result = _result("cut sho", "length")
    body = _turn().finished(output_items(result.outputs[0], None), result)
    assert body["status"] == "incomplete" and body["output"][0]["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    Response.model_validate(body)


def _streamed(text: str, tool_format, finish_reason="stop") -> tuple[list[dict], list]:
    """Events for `text` fed a character at a time, each parsed by the client's models."""
    output = OutputStream(EventWriter(), tool_format)
    frames = []
    for end in range(1, len(text) + 1):
        frames += output.feed(text[:end], end == len(text))
    frames += output.finish(finish_reason)
    events = [json.loads(frame.split("data: ", 1)[1]) for frame in frames]
    for frame, event in zip(frames, events):
        assert frame.startswith(f"event: {event['type']}\n")
        EVENTS.validate_python(event)
    return events, output.items


@pytest.mark.parametrize("text,tool_format", [(CALL_TEXT, HERMES), ("  Just text. ", HERMES),
                                              ("Plain <tool_call> text ", None)])
def test_streamed_items_equal_the_whole_answer(text, tool_format):
    events, items = _streamed(text, tool_format)
    whole = output_items(_result(text).outputs[0], tool_format)
    strip_ids = lambda items: [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                               for item in items]
    assert strip_ids(items) == strip_ids(whole)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == (whole[0]["content"][0]["text"] if whole[0]["type"] == "message" else "")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_events_come_in_openais_order():
    events, _ = _streamed(CALL_TEXT, HERMES)
    kinds = [e["type"].removeprefix("response.") for e in events]
    # a run of deltas counted once: a call's arguments stream in pieces as they are written
    runs = [kind for i, kind in enumerate(kinds)
            if not (kind.endswith(".delta") and i and kinds[i - 1] == kind)]
    assert runs == (["output_item.added", "content_part.added", "output_text.delta",
                     "output_text.done", "content_part.done", "output_item.done"]
                    + ["output_item.added", "function_call_arguments.delta",
                       "function_call_arguments.done", "output_item.done"] * 2)
    assert kinds.count("function_call_arguments.delta") > 2
    assert [e["output_index"] for e in events if e["type"].endswith("item.done")] == [0, 1, 2]


def test_a_call_cut_off_by_max_tokens_closes_incomplete():
    """Its name and the arguments written so far went out as they came; the stream's end
    closes the item as incomplete, with those arguments."""
    cut = CALL_TEXT[:CALL_TEXT.index('"b": 3')]
    events, items = _streamed(cut, HERMES, finish_reason="length")
    assert [item["type"] for item in items] == ["message", "function_call"]
    call = items[1]
    assert call["status"] == "incomplete" and call["name"] == "add"
    assert call["arguments"] == '{"a": 2, '
    assert events[-1]["type"] == "response.output_item.done"
    assert events[-1]["item"]["status"] == "incomplete"


def test_an_empty_answer_is_still_one_message():
    events, items = _streamed("", None)
    assert [i["type"] for i in items] == ["message"] and items[0]["content"][0]["text"] == ""
    assert events[0]["type"] == "response.output_item.added"


class _Engine:
    """Streams `text` in three pieces, then finishes, or fails instead when `fail`."""

    def __init__(self, text: str, fail: bool = False):
        self.text, self.fail = text, fail

    async def generate(self, prepared, output_kind):
        assert output_kind == RequestOutputKind.CUMULATIVE  # the parsers read whole replies
        cuts = [len(self.text) // 3, 2 * len(self.text) // 3]
        for cut in cuts:
            yield _result(self.text[:cut], None)
        if self.fail:
            raise RequestFailedError("the worker fell over")
        yield _result(self.text)


def _event_stream(engine: _Engine, store: ResponseStore, **fields) -> list[dict]:
    turn = _turn(**fields)
    job = Job(kind="chat", response_id=turn.response_id, model="smol", created=1,
              prepared=[None], n=1, tool_format=HERMES if "tools" in fields else None)

    async def frames():
        return [frame async for frame in response_events(engine, job, turn, store)]

    events = [json.loads(frame.split("data: ", 1)[1]) for frame in asyncio.run(frames())]
    for event in events:
        EVENTS.validate_python(event)
    return events


def test_a_stream_ends_with_the_whole_response_and_stores_it():
    store = ResponseStore(capacity=4)
    events = _event_stream(_Engine(CALL_TEXT), store, tools=[ADD])
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["usage"]["output_tokens"] == 7
    assert [i["type"] for i in final["output"]] == ["message", "function_call",
                                                    "function_call"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"] and store.get("resp_1").body == final


def test_an_engine_failure_midway_is_response_failed():
    store = ResponseStore(capacity=4)
    events = _event_stream(_Engine("some words of text", fail=True), store)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "the worker fell over"
    assert events[-1]["response"]["status"] == "failed" and store.get("resp_1") is None


# ---- the store --------------------------------------------------------------------------
def test_the_store_keeps_whole_conversations_least_recently_used_out_first():
    store = ResponseStore(capacity=2)
    for number in range(3):
        turn = _turn()
        turn.response_id = f"resp_{number}"
        result = _result(f"answer {number}")
        store.keep(turn, turn.finished(output_items(result.outputs[0], None), result))
    assert store.get("resp_0") is None and len(store) == 2
    conversation = store.get("resp_1").conversation
    assert [(i.role, i.content) for i in conversation] == [("user", "hi"),
                                                           ("assistant", "answer 1")]
    unstored = _turn(store=False)
    store.keep(unstored, unstored.body("completed"))
    assert store.get("resp_1") is not None and store.delete("resp_1")
    assert not store.delete("resp_1") and store.get("resp_1") is None


def test_output_calls_continue_as_function_call_items():
    items = as_input_items(output_items(_result(CALL_TEXT).outputs[0], HERMES))
    assert [item.type for item in items] == ["message", "function_call", "function_call"]
    assert items[1].name == "add" and json.loads(items[1].arguments) == {"a": 2, "b": 3}


# ---- end to end on the real model -------------------------------------------------------
@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused"), smol_server


ASK = "What is 2 plus 3? Use the add tool."


@pytest.mark.slow
def test_text_whole_and_streamed_alike(client):
    openai_client, _ = client
    args = dict(model="smol", input="Name a colour.", instructions="Answer in one sentence.",
                max_output_tokens=12, temperature=0)
    whole = openai_client.responses.create(**args)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens <= 12
    kinds, deltas = [], []
    with openai_client.responses.stream(**args) as stream:  # the client's accumulator too
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        streamed = event.response  # the last event's: get_final_response() needs completed
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert "".join(deltas) == streamed.output_text == whole.output_text
    assert streamed.id != whole.id


@pytest.mark.slow
def test_a_function_call_then_its_output_through_previous_response_id(client):
    openai_client, server = client
    first = openai_client.responses.create(
        model="smol", input=ASK, tools=[ADD], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=48, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add", first.output
    jsonschema.validate(json.loads(calls[0].arguments), ADD["parameters"])
    events = list(openai_client.responses.create(  # streamed: a streamed turn is stored too
        model="smol", previous_response_id=first.id, tools=[ADD], max_output_tokens=8,
        temperature=0, stream=True, input=[{"type": "function_call_output",
                                            "call_id": calls[0].call_id, "output": "5"}]))
    second = events[-1].response
    assert events[-1].type == f"response.{second.status}", events[-1]
    assert second.previous_response_id == first.id and second.output
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert openai_client.responses.retrieve(second.id).output_text == second.output_text
    assert openai_client.responses.retrieve(first.id).output[-1].id == calls[0].id
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)


@pytest.mark.slow
def test_an_unstored_response_cannot_be_continued(client):
    openai_client, _ = client
    first = openai_client.responses.create(model="smol", input="Hi", store=False,
                                           max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.responses.create(model="smol", input="Again", max_output_tokens=2,
                                       previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"


@pytest.mark.slow
def test_json_schema_text_format(client):
    openai_client, _ = client
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    response = openai_client.responses.create(
        model="smol", input="Name a colour as JSON.", max_output_tokens=24, temperature=0,
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


@pytest.mark.slow
@pytest.mark.parametrize("fields,param,named", [
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input", "input_file"),
    ({"tools": [ADD], "text": {"format": {"type": "json_object"}}, "tool_choice": "required"},
     "tools", "text.format"),
])
def test_refusals_over_http_name_the_field(client, fields, param, named):
    _, server = client
    body = {"model": "smol", "input": "hi", "max_output_tokens": 4, **fields}
    response = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"], error
