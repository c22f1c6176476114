"""Tool calls parsed out of a model's text: whole (a finished answer) or as OpenAI's streaming
deltas (content while no call has begun, then each call once it is complete: its id and name,
then its arguments)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.openai.tools.formats import ToolFormat

_DECODER = json.JSONDecoder()
_LLAMA_CALL_START = '{"name"'


@dataclass
class ParsedCalls:
    content: str  # the text outside the calls that parsed
    calls: list[dict[str, Any]]  # OpenAI's tool_calls entries
    first_call_at: int  # where the first call (complete or not) begins; len(text) if none


def parse_tool_calls(text: str, tool_format: ToolFormat) -> ParsedCalls:
    """Every complete call in `text`, in order; an unfinished or malformed one, and all after
    it, stay text."""
    content, calls, position, first_call_at = [], [], 0, len(text)
    while True:
        start = _next_call(text, position, tool_format)
        decoded = _decode_call(text, start, tool_format) if start >= 0 else None
        if start >= 0:
            first_call_at = min(first_call_at, start)
        if decoded is None:
            content.append(text[position:])
            return ParsedCalls("".join(content), calls, first_call_at)
        call, end = decoded
        content.append(text[position:start])
        calls.append(call)
        position = end


def _next_call(text: str, position: int, tool_format: ToolFormat) -> int:
    return text.find(tool_format.begin or _LLAMA_CALL_START, position)


def _decode_call(text: str, start: int, tool_format: ToolFormat
                 ) -> tuple[dict[str, Any], int] | None:
    """(the call, where it ends) for the call at `start`, or None."""
    index = _skip_space(text, start + len(tool_format.begin))
    try:
        body, index = _DECODER.raw_decode(text, index)
    except json.JSONDecodeError:
        return None
    name = body.get("name") if isinstance(body, dict) else None
    arguments = body.get(tool_format.arguments_key, body.get("arguments", {})) \
        if isinstance(body, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        return None
    if tool_format.end:
        index = _skip_space(text, index)
        if not text.startswith(tool_format.end, index):
            return None
        index += len(tool_format.end)
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}, index


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index].isspace():
        index += 1
    return index


@dataclass
class StreamingToolParser:
    """One choice's stream: `feed(text so far, finished)` -> the deltas to send now."""

    tool_format: ToolFormat
    content_sent: int = 0
    calls_sent: int = 0

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        parsed = parse_tool_calls(text, self.tool_format)
        deltas = []
        content_end = len(text) if finished and not parsed.calls else \
            min(parsed.first_call_at, self._safe_end(text))
        if content_end > self.content_sent:
            deltas.append({"content": text[self.content_sent:content_end]})
            self.content_sent = content_end
        for index in range(self.calls_sent, len(parsed.calls)):
            call = parsed.calls[index]
            function = call["function"]
            deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                           "function": {"name": function["name"],
                                                        "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {
                "arguments": function["arguments"]}}]})
        self.calls_sent = len(parsed.calls)
        return deltas

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def _safe_end(self, text: str) -> int:
        """Where content may be sent up to: short of a tail that could begin a call."""
        marker = self.tool_format.begin or _LLAMA_CALL_START
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)
