"""Responses API objects: output items (an assistant message, function calls), usage, and the
response object itself, which echoes the request's settings as OpenAI's does (the `openai`
client's `Response` model and `output_text` read it)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.openai.harmony import parse_messages
from kvserve.entrypoints.openai.reasoning.parser import ThinkingPlan, split_reasoning
from kvserve.entrypoints.openai.responses.protocol import (
    InputItem,
    ResponsesRequest,
    ToolChoiceFunction,
)
from kvserve.entrypoints.openai.tools.formats import ToolFormat
from kvserve.entrypoints.openai.tools.parser import new_call_id, parse_tool_calls
from kvserve.outputs import CompletionOutput, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; text None while it is being streamed (no content part yet)."""
    content = [] if text is None else [{"type": "output_text", "text": text,
                                         "annotations": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def function_call_item(item_id: str, call: dict[str, Any], arguments: str,
                       status: str) -> dict[str, Any]:
    """A function call from the tool parser's chat-shaped call ({"id", "function"})."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": arguments, "status": status}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning model's thinking, as reasoning text (no summary is written); text None
    while it is being streamed."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(sample: CompletionOutput, tool_format: ToolFormat | None,
                 harmony: bool = False, reasoning: ThinkingPlan | None = None
                 ) -> list[dict[str, Any]]:
    """A whole answer's items: its text as a message, or with tools the text before the first
    call (stripped; none when empty and calls follow), then one item per call; a harmony
    model's (gpt-oss) an item per message of its turn; a thinking model's (`reasoning`) its
    thinking as a reasoning item before the answer's items (its text stripped). The streamed
    items are the same (`stream.OutputStream`)."""
    status = item_status(sample.finish_reason)
    if harmony:
        return harmony_items(sample.text, status)
    if reasoning is not None:
        return thinking_items(sample.text, reasoning, tool_format, status)
    if tool_format is None:
        return [message_item(new_id("msg"), sample.text, status)]
    return _answer_items(sample.text, tool_format, status)


def _answer_items(text: str, tool_format: ToolFormat | None,
                  status: str) -> list[dict[str, Any]]:
    """The text (stripped) before the first call as a message (none when empty and calls
    follow), then one item per call."""
    calls = []
    if tool_format is not None:
        parsed = parse_tool_calls(text, tool_format)
        calls = parsed.calls
        text = text[:parsed.first_call_at] if calls else parsed.content
    text = text.strip()
    items = [function_call_item(new_id("fc"), call, call["function"]["arguments"],
                                "completed") for call in calls]
    if text or not items:
        items.insert(0, message_item(new_id("msg"), text,
                                     "completed" if items else status))
    return items


def thinking_items(text: str, plan: ThinkingPlan, tool_format: ToolFormat | None,
                   status: str) -> list[dict[str, Any]]:
    """A thinking reply's items: its thinking as a reasoning item (complete once anything of
    the answer follows; the answer's status when nothing does), then the answer's items (none
    when it is empty after the thinking)."""
    thought, answer = split_reasoning(text, plan)
    if thought is None:
        return _answer_items(answer or "", tool_format, status)
    answer_items = [] if answer is None or not answer.strip() else _answer_items(
        answer, tool_format, status)
    reasoning = reasoning_item(new_id("rs"), thought,
                               "completed" if answer_items else status)
    return [reasoning, *answer_items]


def harmony_items(text: str, status: str) -> list[dict[str, Any]]:
    """A harmony turn's messages as items: analysis as reasoning, a message to functions.NAME
    as a function call, the rest (final, preambles) as a message; consecutive messages of one
    kind other than calls share an item (as streamed); the last takes the answer's status
    unless its end marker was written."""
    items: list[dict[str, Any]] = []
    for message in parse_messages(text):
        state = "completed" if message.complete else status
        if message.field == "tool_calls":
            call = {"id": new_call_id(), "function": {"name": message.tool_name}}
            items.append(function_call_item(new_id("fc"), call, message.body, state))
            continue
        kind = "reasoning" if message.field == "reasoning_content" else "message"
        if items and items[-1]["type"] == kind:  # the text so far, then this message's
            body = items[-1]["content"][0]["text"] + message.body
            items.pop()
        else:
            body = message.body
        make = reasoning_item if kind == "reasoning" else message_item
        items.append(make(new_id("rs" if kind == "reasoning" else "msg"), body, state))
    return items or [message_item(new_id("msg"), "", status)]


def usage(output: RequestOutput) -> dict[str, Any]:
    input_tokens = len(output.prompt_token_ids)
    output_tokens = sum(len(sample.token_ids) for sample in output.outputs)
    # cache_write_tokens: OpenAI bills writes to its explicit prompt cache; none here
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


@dataclass
class Turn:
    """One /v1/responses call: the settings its response object echoes, and the conversation
    (earlier turns and this input) that a later previous_response_id continues."""

    request: ResponsesRequest
    response_id: str
    model: str
    created_at: int
    conversation: list[InputItem]

    def body(self, status: str = "in_progress", output: list[dict[str, Any]] | None = None,
             result: RequestOutput | None = None, error: dict[str, Any] | None = None
             ) -> dict[str, Any]:
        """The response object; with the finished `result`, its usage and status."""
        request = self.request
        finished = result is not None and status != "failed"
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model, "output": output or [],
            "usage": usage(result) if finished else None,
            "instructions": request.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "tool_choice": (request.tool_choice.model_dump()
                            if isinstance(request.tool_choice, ToolChoiceFunction)
                            else request.tool_choice or "auto"),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "text": (request.text.model_dump(by_alias=True, exclude_none=True)
                     if request.text and request.text.format else {"format": {"type": "text"}}),
            "truncation": "disabled", "store": request.stores, "background": False,
            "metadata": request.metadata or {}, "user": request.user,
        }

    def finished(self, output: list[dict[str, Any]], result: RequestOutput) -> dict[str, Any]:
        status = item_status(result.outputs[0].finish_reason)
        return self.body(status, output, result)
