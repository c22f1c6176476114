"""A streamed response as OpenAI's Responses events, in OpenAI's order: response.created and
.in_progress; per output item .output_item.added, then for a message .content_part.added,
.output_text.delta..., .output_text.done, .content_part.done, for a function call
.function_call_arguments.delta and .done, for reasoning (a harmony model's, or a thinking
model's with --reasoning-parser) .reasoning_text.delta and .done; .output_item.done; finally response.completed,
.incomplete or .failed. Every event carries `type` and a `sequence_number`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from kvserve.engine.async_engine import AsyncEngine
from kvserve.entrypoints.openai.errors import engine_error_body
from kvserve.entrypoints.openai.harmony import StreamingHarmonyParser
from kvserve.entrypoints.openai.reasoning.parser import ReasoningStream, ThinkingPlan
from kvserve.entrypoints.openai.responses.objects import (
    Turn,
    function_call_item,
    item_status,
    message_item,
    new_id,
    reasoning_item,
)
from kvserve.entrypoints.openai.responses.store import ResponseStore
from kvserve.entrypoints.openai.serving import Job, merged_stream
from kvserve.sampling_params import RequestOutputKind
from kvserve.entrypoints.openai.tools.formats import ToolFormat
from kvserve.entrypoints.openai.tools.parser import StreamingToolParser

logger = logging.getLogger("kvserve.requests")


@dataclass
class EventWriter:
    """SSE frames (`event:` and `data:` lines, as OpenAI sends them), numbered in order."""

    sequence: int = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class OutputStream:
    """One answer's output items as events, fed its text so far. Without tools the text is one
    message, streamed as it grows. With tools the tool parser splits it: text before the first
    call is the message (stripped, as `objects.output_items` strips it: leading whitespace is
    dropped and trailing whitespace held back until more text follows), each call an item of
    its own, opened as soon as its name is known, its arguments streamed as they are written,
    closed once the call parsed whole. `items` is the finished output."""

    event: EventWriter
    tool_format: ToolFormat | None = None
    harmony: bool = False  # gpt-oss: its reasoning streams as a reasoning item
    reasoning: ThinkingPlan | None = None  # a thinking model's: its thinking too
    items: list[dict[str, Any]] = field(default_factory=list)
    _message: dict[str, Any] | None = None
    _text: list[str] = field(default_factory=list)
    _held: str = ""
    _sent: int = 0
    _parser: StreamingToolParser | StreamingHarmonyParser | ReasoningStream | None = None
    _tools: StreamingToolParser | None = None
    _call: dict[str, Any] | None = None
    _arguments: list[str] = field(default_factory=list)
    _reasoning: dict[str, Any] | None = None
    _thought: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.harmony:
            self._parser = StreamingHarmonyParser()
            return
        if self.tool_format is not None:
            self._parser = self._tools = StreamingToolParser(self.tool_format)
        if self.reasoning is not None:
            self._parser = ReasoningStream(self.reasoning, self._tools)

    def feed(self, text: str, finished: bool) -> list[str]:
        if self._parser is None:
            delta, self._sent = text[self._sent:], len(text)
            return self._content(delta)
        if self.harmony:
            return self._harmony(text, finished)
        events: list[str] = []
        for delta in self._parser.feed(text, finished):
            if "reasoning_content" in delta:
                events += self._thinking(delta["reasoning_content"])
            elif "content" in delta:
                piece = self._trimmed(delta["content"])
                if piece:  # the answer begun: the thinking is over
                    events += self._close_reasoning("completed") + self._content(piece)
            else:
                events += self._close_reasoning("completed") + \
                    self._tool_call(delta["tool_calls"][0])
        tools = self._tools
        if self._call is not None and tools.calls_done == tools.calls_started:
            events += self._close_call("completed")
        return events

    def finish(self, finish_reason: str | None) -> list[str]:
        """Close the open item (a call cut off by max_tokens is incomplete); an answer with no
        item at all is an empty message."""
        status = item_status(finish_reason)
        if self._message is None and self._call is None and self._reasoning is None \
                and not self.items:
            return self._open_message() + self._close_message(status)
        return self._close_reasoning(status) + self._close_message(status) + \
            self._close_call(status)

    def _harmony(self, text: str, finished: bool) -> list[str]:
        """A harmony turn's deltas (`harmony.StreamingHarmonyParser`): reasoning, content and
        calls, each opening its item (and closing the one before) as it starts."""
        events: list[str] = []
        for delta in self._parser.feed(text, finished):
            if "reasoning_content" in delta:
                events += self._thinking(delta["reasoning_content"])
            elif "content" in delta:
                events += self._close_reasoning("completed") + \
                    self._close_call("completed") + self._content(delta["content"])
            else:
                events += self._close_reasoning("completed") + \
                    self._tool_call(delta["tool_calls"][0])
        return events

    def _thinking(self, delta: str) -> list[str]:
        events = self._close_message("completed") + self._close_call("completed")
        if self._reasoning is None:
            self._reasoning = reasoning_item(new_id("rs"), None, "in_progress")
            self._thought = []
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.items), item=self._reasoning))
        self._thought.append(delta)
        return events + [self.event("response.reasoning_text.delta", **self._reasoning_where(),
                                    content_index=0, delta=delta)]

    def _close_reasoning(self, status: str) -> list[str]:
        if self._reasoning is None:
            return []
        text = "".join(self._thought)
        item = reasoning_item(self._reasoning["id"], text, status)
        events = [self.event("response.reasoning_text.done", **self._reasoning_where(),
                             content_index=0, text=text),
                  self.event("response.output_item.done", output_index=len(self.items),
                             item=item)]
        self.items.append(item)
        self._reasoning = None
        return events

    def _reasoning_where(self) -> dict[str, Any]:
        return {"item_id": self._reasoning["id"], "output_index": len(self.items)}

    def _trimmed(self, piece: str) -> str:
        piece = self._held + piece
        if self._message is None:
            piece = piece.lstrip()
        kept = piece.rstrip()
        self._held = piece[len(kept):]
        return kept

    def _content(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = self._open_message() if self._message is None else []
        self._text.append(delta)
        return events + [self.event("response.output_text.delta", **self._where(),
                                    content_index=0, delta=delta, logprobs=[])]

    def _open_message(self) -> list[str]:
        self._message = message_item(new_id("msg"), None, "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.output_item.added", output_index=len(self.items),
                           item=self._message),
                self.event("response.content_part.added", **self._where(), content_index=0,
                           part=part)]

    def _close_message(self, status: str) -> list[str]:
        if self._message is None:
            return []
        text = "".join(self._text)
        item = message_item(self._message["id"], text, status)
        part = item["content"][0]
        events = [self.event("response.output_text.done", **self._where(), content_index=0,
                             text=text, logprobs=[]),
                  self.event("response.content_part.done", **self._where(), content_index=0,
                             part=part),
                  self.event("response.output_item.done", output_index=len(self.items),
                             item=item)]
        self.items.append(item)
        self._message = None
        return events

    def _tool_call(self, delta: dict[str, Any]) -> list[str]:
        """The parser gives a call's id and name first, then its arguments in pieces."""
        if "id" in delta:
            events = self._close_message("completed") + self._close_call("completed")
            self._call = function_call_item(new_id("fc"), delta, "", "in_progress")
            self._arguments = []
            return events + [self.event("response.output_item.added",
                                        output_index=len(self.items), item=self._call)]
        piece = delta["function"]["arguments"]
        self._arguments.append(piece)
        return [self.event("response.function_call_arguments.delta", **self._call_where(),
                           delta=piece)]

    def _close_call(self, status: str) -> list[str]:
        if self._call is None:
            return []
        arguments = "".join(self._arguments)
        item = {**self._call, "arguments": arguments, "status": status}
        events = [self.event("response.function_call_arguments.done", **self._call_where(),
                             arguments=arguments),
                  self.event("response.output_item.done", output_index=len(self.items),
                             item=item)]
        self.items.append(item)
        self._call = None
        return events

    def _call_where(self) -> dict[str, Any]:
        return {"item_id": self._call["id"], "output_index": len(self.items)}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._message["id"], "output_index": len(self.items)}


async def response_events(engine: AsyncEngine, job: Job, turn: Turn,
                          store: ResponseStore) -> AsyncIterator[str]:
    """The whole event stream of one response; stored once complete (with `store`). An engine
    failure midway ends it with response.failed rather than a cut connection."""
    event = EventWriter()
    yield event("response.created", response=turn.body())
    yield event("response.in_progress", response=turn.body())
    output = OutputStream(event, job.tool_format, job.harmony, job.reasoning)
    try:
        result = None
        # whole replies: the parsers look back over the text each step
        async for _, result in merged_stream(engine, job, RequestOutputKind.CUMULATIVE):
            sample = result.outputs[0]
            for frame in output.feed(sample.text, sample.finish_reason is not None):
                yield frame
        for frame in output.finish(result.outputs[0].finish_reason):
            yield frame
    except Exception as exc:  # engine failure mid-stream: tell the client, then end
        logger.warning("stream %s failed: %s", job.response_id, exc)
        error = {"code": "server_error", "message": engine_error_body(exc)[1]["error"][
            "message"]}
        yield event("response.failed", response=turn.body("failed", output.items, error=error))
        return
    body = turn.finished(output.items, result)
    store.keep(turn, body)
    yield event(f"response.{body['status']}", response=body)
