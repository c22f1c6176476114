"""An answer's text as Anthropic content blocks (thinking, text and tool_use), built as the
text grows, with the events that build them: content_block_start, content_block_delta
(thinking_delta and signature_delta, text_delta, input_json_delta) and content_block_stop, as
dicts. A whole answer is one feed of its text, so a message and its stream are built by the
same code and agree."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.entrypoints.openai.harmony import StreamingHarmonyParser
from kvserve.entrypoints.openai.reasoning.parser import ReasoningStream, ThinkingPlan
from kvserve.entrypoints.openai.tools.formats import ToolFormat
from kvserve.entrypoints.openai.tools.parser import StreamingToolParser


# this server signs nothing: an empty signature, as llama.cpp's server sends (clients require
# the field and send it back unread)
SIGNATURE = ""


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


@dataclass
class ContentBlocks:
    """`feed(text so far, finished)` -> the events to send now; `blocks` is the content.

    Without tools the text is one text block, streamed as written. With tools the tool parser
    splits it (a harmony model's channels, its parser): the text before the first call is a
    text block (stripped, as the chat and Responses paths strip it: leading whitespace
    dropped, trailing whitespace held back until more text follows), each call a tool_use
    block opened as soon as its name is known, its input streamed as the model writes it. A
    block closes when the next one opens or the answer ends.

    A thinking model's thinking (`reasoning`: --reasoning-parser's plan for the reply, read by
    the chat path's own `ReasoningStream`; harmony's analysis channel) is a thinking block
    first, its text streamed as thinking_delta, closed by a signature_delta; the answer after
    it is stripped as a tool answer is. `show_thinking` false (thinking disabled) drops it."""

    tool_format: ToolFormat | None = None
    harmony: bool = False
    reasoning: ThinkingPlan | None = None
    show_thinking: bool = True
    blocks: list[dict[str, Any]] = field(default_factory=list)
    _open: bool = False  # whether the last block is still being written
    _parser: StreamingToolParser | StreamingHarmonyParser | ReasoningStream | None = None
    _sent: int = 0  # plain text: how much of it went out
    _held: str = ""  # with tools: trailing whitespace held back
    _input: list[str] = field(default_factory=list)  # the open tool_use block's input text

    def __post_init__(self):
        if self.harmony:
            self._parser = StreamingHarmonyParser()
            return
        tools = StreamingToolParser(self.tool_format) if self.tool_format is not None else None
        self._parser = ReasoningStream(self.reasoning, tools) if self.reasoning else tools

    @property
    def called(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks)

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        if self._parser is None:
            delta, self._sent = text[self._sent:], len(text)
            return self._text(delta)
        events: list[dict[str, Any]] = []
        for delta in self._parser.feed(text, finished):
            if "reasoning_content" in delta:
                events += self._thinking(delta["reasoning_content"])
            elif "content" in delta:
                piece = delta["content"]
                events += self._text(piece if self.harmony else self._trimmed(piece))
            elif "tool_calls" in delta:
                events += self._tool_call(delta["tool_calls"][0])
        return events

    def close(self) -> list[dict[str, Any]]:
        """Close the open block (a tool_use block takes its input: the object its text
        decodes to, {} when it was cut off before it was whole)."""
        if not self._open:
            return []
        self._open = False
        block, index = self.blocks[-1], len(self.blocks) - 1
        events = []
        if block["type"] == "tool_use":
            block["input"] = _decoded_input("".join(self._input))
        elif block["type"] == "thinking":  # Anthropic's streams sign a thinking block last
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": SIGNATURE}})
        return events + [{"type": "content_block_stop", "index": index}]

    def whole(self, text: str) -> list[dict[str, Any]]:
        """A finished answer's content blocks."""
        self.feed(text, True)
        self.close()
        return self.blocks

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        self._open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                          "content_block": dict(block)}]

    def _text(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = []
        if not self._open or self.blocks[-1]["type"] != "text":
            events = self._start({"type": "text", "text": ""})
        self.blocks[-1]["text"] += delta
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": {"type": "text_delta", "text": delta}}]

    def _thinking(self, delta: str) -> list[dict[str, Any]]:
        if not delta or not self.show_thinking:
            return []
        events = []
        if not self._open or self.blocks[-1]["type"] != "thinking":
            events = self._start({"type": "thinking", "thinking": "", "signature": SIGNATURE})
        self.blocks[-1]["thinking"] += delta
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": {"type": "thinking_delta", "thinking": delta}}]

    def _trimmed(self, piece: str) -> str:
        piece = self._held + piece
        if all(block["type"] == "thinking" for block in self.blocks):  # the answer's start
            piece = piece.lstrip()
        kept = piece.rstrip()
        self._held = piece[len(kept):]
        return kept

    def _tool_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The parsers give a call's id and name first, then its arguments in pieces."""
        if "id" in delta:
            events = self._start({"type": "tool_use", "id": new_tool_use_id(),
                                  "name": delta["function"]["name"], "input": {}})
            self._input = []  # after _start closed the block before (a call's too)
            return events
        piece = delta["function"]["arguments"]
        if not piece:
            return []
        self._input.append(piece)
        return [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                 "delta": {"type": "input_json_delta", "partial_json": piece}}]


def _decoded_input(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
