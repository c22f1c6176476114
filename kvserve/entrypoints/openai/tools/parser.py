"""Tool calls parsed out of a model's text: whole (a finished answer) or as OpenAI's streaming
deltas, sent the way OpenAI and vLLM's hermes parser send them: content while no call has
begun, then for each call its id and name as soon as the call's header up to its arguments
(`{"name": "X", "arguments": `) is written, then its arguments' JSON text in pieces as the
model writes it. A call's argument pieces put together are exactly the `arguments` the whole
parse gives: both are the model's own text of the object (checked to decode), not a
re-encoding, so a client sees the same call streamed or not. A call laid out otherwise (the
name after the arguments, arguments given as a JSON string) goes out whole once it parses."""

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


@dataclass
class _Call:
    name: str
    arguments: str  # the JSON text OpenAI's `arguments` carries
    end: int  # just past the call's text (its end marker included)


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
        content.append(text[position:start])
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": decoded.name, "arguments": decoded.arguments}})
        position = decoded.end


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _next_call(text: str, position: int, tool_format: ToolFormat) -> int:
    return text.find(tool_format.begin or _LLAMA_CALL_START, position)


def _decode_call(text: str, start: int, tool_format: ToolFormat) -> _Call | None:
    """The call at `start`, or None while it is unfinished or when it is malformed."""
    try:
        members = _object_members(text, _skip_space(text, start + len(tool_format.begin)))
    except json.JSONDecodeError:
        return None
    if members is None:
        return None
    fields, index = members
    name = fields.get("name", (None,))[0]
    arguments = _arguments_text(text, fields, tool_format)
    if not isinstance(name, str) or arguments is None:
        return None
    if tool_format.end:
        index = _skip_space(text, index)
        if not text.startswith(tool_format.end, index):
            return None
        index += len(tool_format.end)
    return _Call(name, arguments, index)


def _object_members(text: str, index: int
                    ) -> tuple[dict[str, tuple[Any, int, int]], int] | None:
    """The JSON object at `index` member by member: key -> (value, where the value's text
    starts, where it ends), and where the object ends. The spans let a call's arguments be
    the model's own text; the first of a repeated key counts, as it does when streamed."""
    if not text.startswith("{", index):
        return None
    fields: dict[str, tuple[Any, int, int]] = {}
    index = _skip_space(text, index + 1)
    if text.startswith("}", index):
        return fields, index + 1
    while True:
        key, index = _DECODER.raw_decode(text, index)
        index = _skip_space(text, index)
        if not isinstance(key, str) or not text.startswith(":", index):
            return None
        start = _skip_space(text, index + 1)
        value, index = _DECODER.raw_decode(text, start)
        fields.setdefault(key, (value, start, index))
        index = _skip_space(text, index)
        if text.startswith("}", index):
            return fields, index + 1
        if not text.startswith(",", index):
            return None
        index = _skip_space(text, index + 1)


def _arguments_text(text: str, fields: dict[str, tuple[Any, int, int]],
                    tool_format: ToolFormat) -> str | None:
    """OpenAI's `arguments` string: an object's text as the model wrote it (what the stream
    sends piece by piece), a string argument as it is, `{}` when there are none."""
    key = next((k for k in (tool_format.arguments_key, "arguments") if k in fields), None)
    if key is None:
        return "{}"
    value, start, end = fields[key]
    if isinstance(value, str):
        return value
    return text[start:end] if isinstance(value, dict) else None


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index].isspace():
        index += 1
    return index


# ---- streaming ------------------------------------------------------------------------------
class _NeedMore(Exception):
    """The text ends before it can be told whether it matches."""


class _NoMatch(Exception):
    """The text cannot match."""


@dataclass
class _ValueScanner:
    """Where a JSON object, array or string still being written ends, read a character at a
    time as it arrives (each character once): braces inside strings do not count and an
    escaped quote does not close a string. It follows nesting only, not validity: the whole
    call is decoded properly once it ends. Every character up to the end belongs to the
    value, so what it has read can be sent at once, with no lookahead."""

    start: int  # the value's first character: `{`, `[` or `"`
    position: int = -1  # how far it has read
    end: int | None = None  # just past the value's last character, once read
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def __post_init__(self):
        self.position = self.start

    def scan(self, text: str) -> int:
        """Read what has arrived; how far the value's text reaches (to its end once read)."""
        while self.end is None and self.position < len(text):
            if self._closes(text[self.position]):
                self.end = self.position + 1
            self.position += 1
        return self.position

    def _closes(self, char: str) -> bool:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def _expect(text: str, index: int, *literals: str) -> int:
    """Past one of `literals` after any whitespace at `index`."""
    index = _skip_space(text, index)
    for literal in literals:
        if text.startswith(literal, index):
            return index + len(literal)
    if any(literal.startswith(text[index:index + len(literal)]) for literal in literals):
        raise _NeedMore  # the text ends inside one (or right at `index`)
    raise _NoMatch


def _arguments_header(text: str, start: int, tool_format: ToolFormat) -> tuple[str, int]:
    """(name, where the arguments object begins) for a call at `start` that opens
    `{"name": "X", "arguments": {` (any whitespace between; `parameters` in Llama 3's format),
    the layout every grammar-constrained call has. Raises _NeedMore while the text ends inside
    the header, _NoMatch for any other layout (which then goes out whole)."""
    index = _expect(text, start + len(tool_format.begin), "{")
    index = _expect(text, index, '"name"')
    index = _expect(text, index, ":")
    name_at = _skip_space(text, index)
    _expect(text, name_at, '"')
    scanner = _ValueScanner(name_at)
    index = scanner.scan(text)
    if scanner.end is None:
        raise _NeedMore
    name = json.loads(text[name_at:index])  # the scanner closed it: a whole string
    index = _expect(text, index, ",")
    index = _expect(text, index, f'"{tool_format.arguments_key}"', '"arguments"')
    index = _expect(text, index, ":")
    _expect(text, index, "{")
    return name, _skip_space(text, index)


@dataclass
class _StreamedCall:
    """The call the stream is in."""

    start: int  # where its begin marker (or Llama 3's `{"name"`) is
    index: int  # its place in tool_calls
    id: str | None = None  # once its id-and-name delta went out
    arguments: _ValueScanner | None = None  # once its arguments stream
    arguments_sent: int = 0  # how far into the text its arguments have gone out
    whole: bool = False  # laid out otherwise: it goes out whole once it parses


@dataclass
class StreamingToolParser:
    """One choice's stream: `feed(text so far, finished)` -> the deltas to send now.

    A call that never completes (max_tokens, a stop string or a malformed end) keeps what
    went out for it (its id and name, its arguments so far), as OpenAI and vLLM do; the whole
    parse of that text keeps such a call as text. Nothing after it is sent as a call."""

    tool_format: ToolFormat
    content_sent: int = 0
    calls_started: int = 0  # calls whose id and name went out
    calls_done: int = 0  # calls whose text is complete and parsed (an item may close)
    _first_call_at: int | None = None
    _search_from: int = 0
    _call: _StreamedCall | None = None

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = []
        while self._advance_call(text, calls):
            pass
        return self._content(text, finished) + calls

    @property
    def called(self) -> bool:
        return self.calls_started > 0

    def _content(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """Text before the first call, short of a tail that may begin one; all of it when the
        answer ended with no call started."""
        if finished and not self.called:
            end = len(text)
        else:
            end = min(self._safe_end(text), len(text) if self._first_call_at is None
                      else self._first_call_at)
        if end <= self.content_sent:
            return []
        delta, self.content_sent = text[self.content_sent:end], end
        return [{"content": delta}]

    def _advance_call(self, text: str, deltas: list[dict[str, Any]]) -> bool:
        """Send what the current call (found first if need be) has ready; True when it ended,
        so the next one may be looked for."""
        call = self._call or self._find_call(text)
        if call is None or not self._arguments_ended(text, call, deltas):
            return False
        decoded = _decode_call(text, call.start, self.tool_format)
        if decoded is None:
            return False
        if call.whole:
            deltas += self._whole_call(call, decoded)
        self._search_from, self._call = decoded.end, None
        self.calls_done += 1
        return True

    def _arguments_ended(self, text: str, call: _StreamedCall,
                         deltas: list[dict[str, Any]]) -> bool:
        """Stream the call's header and arguments as far as they are written; True once its
        arguments have ended (or it goes out whole), so only its close is still to come."""
        if not call.whole and call.arguments is None:
            self._try_header(text, call, deltas)
        if call.arguments is None:
            return call.whole
        self._send_arguments(text, call, deltas)
        return call.arguments.end is not None

    def _find_call(self, text: str) -> _StreamedCall | None:
        start = _next_call(text, self._search_from, self.tool_format)
        if start < 0:
            return None
        if self._first_call_at is None:
            self._first_call_at = start
        self._call = _StreamedCall(start, self.calls_started)
        return self._call

    def _try_header(self, text: str, call: _StreamedCall, deltas: list[dict[str, Any]]):
        """Send the id and name once the header is written; mark the call whole if its
        layout is not the streamable one."""
        try:
            name, arguments_at = _arguments_header(text, call.start, self.tool_format)
        except _NeedMore:
            return
        except (_NoMatch, json.JSONDecodeError):
            call.whole = True
            return
        deltas.append(self._id_and_name(call, name))
        call.arguments, call.arguments_sent = _ValueScanner(arguments_at), arguments_at

    def _send_arguments(self, text: str, call: _StreamedCall, deltas: list[dict[str, Any]]):
        reached = call.arguments.scan(text)
        if reached > call.arguments_sent:
            deltas.append(_arguments_delta(call.index, text[call.arguments_sent:reached]))
            call.arguments_sent = reached

    def _whole_call(self, call: _StreamedCall, decoded: _Call) -> list[dict[str, Any]]:
        return [self._id_and_name(call, decoded.name),
                _arguments_delta(call.index, decoded.arguments)]

    def _id_and_name(self, call: _StreamedCall, name: str) -> dict[str, Any]:
        call.id = new_call_id()
        self.calls_started += 1
        return {"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _safe_end(self, text: str) -> int:
        """Where content may be sent up to: short of a tail that could begin a call."""
        marker = self.tool_format.begin or _LLAMA_CALL_START
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _arguments_delta(index: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
