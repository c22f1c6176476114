"""gpt-oss's harmony format, read out of the model's text: its turn is a run of messages, each
`[<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]
<|message|>BODY` closed by <|end|>, <|call|> (a tool call) or <|return|> (the turn's end); the
first message's `<|start|>assistant` is the prompt's (the chat template's generation prompt).

Messages map onto OpenAI's chat message as vLLM maps them: the `analysis` channel is
`reasoning_content`, a message to `functions.NAME` is a tool call (its body the arguments), and
the rest (`final`, and `commentary` with no recipient: a preamble the user may see) is
`content`. Whole (a finished answer) or as streaming deltas: the text so far is parsed again on
each step and only what grew is sent, so both give the same fields.

The special tokens must be in the text: a harmony model's chat requests are detokenized with
`skip_special_tokens=False` (`speaks_harmony` says which models).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvserve.entrypoints.openai.tools.parser import new_call_id

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_FUNCTIONS = "functions."


def speaks_harmony(chat_template: str | None) -> bool:
    """Whether the model's chat template writes harmony (gpt-oss's)."""
    return bool(chat_template) and CHANNEL in chat_template and MESSAGE in chat_template


def turn_end_token_ids(tokenizer) -> list[int]:
    """The ids of <|call|> and <|return|>, where the model's turn ends (its generation config
    lists them as end-of-sequence tokens beside the tokenizer's one)."""
    ids = (tokenizer.backend.token_to_id(marker) for marker in ENDS[1:])
    return [token for token in ids if token is not None]


@dataclass
class HarmonyMessage:
    channel: str
    recipient: str | None
    body: str
    complete: bool  # its end marker is written

    @property
    def tool_name(self) -> str | None:
        if self.recipient and self.recipient.startswith(_FUNCTIONS):
            return self.recipient[len(_FUNCTIONS):]
        return None

    @property
    def field(self) -> str:
        """The chat message's field this message's body goes to."""
        if self.tool_name is not None:
            return "tool_calls"
        return "reasoning_content" if self.channel == "analysis" else "content"


def parse_messages(text: str) -> list[HarmonyMessage]:
    """The messages written so far; the last may be unfinished (its header complete)."""
    return [message for message, _ in _messages_from(text, 0)]


def _messages_from(text: str, position: int) -> list[tuple[HarmonyMessage, int]]:
    """The messages from `position` (a message's start) on, each with where the next starts."""
    messages = []
    while position < len(text):
        header_end = text.find(MESSAGE, position)
        if header_end < 0:
            break  # a header still being written
        header = text[position:header_end]
        body_start = header_end + len(MESSAGE)
        end, marker = _first_end(text, body_start)
        message = HarmonyMessage(_channel(header), _recipient(header), text[body_start:end],
                                 marker is not None)
        if marker is None:
            messages.append((message, end))
            break
        position = end + len(marker)
        if text.startswith(START, position):
            position += len(START)
        messages.append((message, position))
    return messages


def _first_end(text: str, start: int) -> tuple[int, str | None]:
    found = [(text.find(marker, start), marker) for marker in ENDS]
    found = [(at, marker) for at, marker in found if at >= 0]
    return min(found) if found else (len(text), None)


def _channel(header: str) -> str:
    if CHANNEL not in header:
        return "final"  # a message with no channel: what the user is shown
    after = header.split(CHANNEL, 1)[1]
    return re.split(r"\s|<\|", after.strip(), maxsplit=1)[0]


def _recipient(header: str) -> str | None:
    match = _RECIPIENT.search(header)
    return match[1] if match else None


@dataclass
class HarmonyReply:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]]


def parse_reply(text: str) -> HarmonyReply:
    """A finished turn's text as the chat message's fields (None where a field has none)."""
    content, reasoning, calls = [], [], []
    for message in parse_messages(text):
        if message.field == "tool_calls":
            calls.append(_call(new_call_id(), message.tool_name, message.body))
        elif message.field == "reasoning_content":
            reasoning.append(message.body)
        else:
            content.append(message.body)
    return HarmonyReply("".join(content) or None, "".join(reasoning) or None, calls)


@dataclass
class StreamingHarmonyParser:
    """One choice's stream: `feed(text so far, finished)` -> the deltas to send now. Each step
    parses from the first message not yet complete (the ones before never change)."""

    completed: int = 0  # messages whose end marker was seen (and whose body all went out)
    resume: int = 0  # where the first incomplete message starts in the text
    sent: int = 0  # how much of that message's body went out
    call_ids: dict[int, tuple[int, str]] = field(default_factory=dict)  # message -> (index, id)

    def feed(self, text: str, finished: bool = False) -> list[dict[str, Any]]:
        deltas = []
        for message, next_start in _messages_from(text, self.resume):
            number = self.completed
            piece = message.body[self.sent:]
            if message.field == "tool_calls":
                deltas += self._call_deltas(number, message, piece)
            elif piece:
                deltas.append({message.field: piece})
            self.sent = len(message.body)
            if message.complete:
                self.completed, self.resume, self.sent = number + 1, next_start, 0
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.call_ids)

    def _call_deltas(self, number: int, message: HarmonyMessage,
                     piece: str) -> list[dict[str, Any]]:
        deltas = []
        if number not in self.call_ids:
            self.call_ids[number] = (len(self.call_ids), new_call_id())
            index, call_id = self.call_ids[number]
            deltas.append({"tool_calls": [dict(_call(call_id, message.tool_name, ""),
                                               index=index)]})
        if piece:
            index = self.call_ids[number][0]
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return deltas


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
