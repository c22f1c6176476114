"""A Messages API conversation as the chat messages the chat path renders: the system prompt
first, then each message's blocks: text as the turn's content, an assistant's tool_use blocks
as its tool_calls and its thinking blocks as its reasoning_content (which the template keeps
or drops; redacted thinking is dropped), a user's tool_result blocks as tool messages (which
the tool prompt writes back as <tool_response> blocks, or a template with tools renders
itself)."""

from __future__ import annotations

import json
from typing import Any

from kvserve.errors import InvalidRequestError

# several text blocks of one turn are one text, a line apart (as vLLM joins text parts)
TEXT_JOINER = "\n"


def chat_messages(system: list | None, messages: list) -> list[dict[str, Any]]:
    """The chat messages of `system` (text blocks) and `messages` (protocol.Message). A last
    assistant message (a partial answer to continue: Anthropic's prefill) is a 400, as the
    Messages API answers on models that cannot continue one."""
    chat: list[dict[str, Any]] = []
    system_text = TEXT_JOINER.join(block.text for block in system or [])
    if system_text:
        chat.append({"role": "system", "content": system_text})
    for number, message in enumerate(messages):
        if message.role == "assistant":
            chat.append(_assistant_turn(number, message.content))
        else:
            chat += _turn(number, message.role, message.content)
    if messages and messages[-1].role == "assistant":
        raise InvalidRequestError(
            f"messages.{len(messages) - 1}: a conversation ending with an assistant message "
            "(prefill, a partial answer to continue) is not supported by this server; end with "
            "a user message", param="messages")
    return chat


def _turn(number: int, role: str, blocks: list) -> list[dict[str, Any]]:
    """A user (or system) message: its text, and each tool result as a tool message, in the
    order given (Anthropic puts the results first)."""
    turn: list[dict[str, Any]] = []
    text: list[str] = []
    for index, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text)
            continue
        if block.type != "tool_result" or role != "user":
            raise _misplaced(number, index, block.type, role)
        turn += _text_message(role, text)
        text = []
        turn.append({"role": "tool", "tool_call_id": block.tool_use_id,
                     "content": _result_text(block)})
    return turn + _text_message(role, text)


def _assistant_turn(number: int, blocks: list) -> dict[str, Any]:
    """An earlier answer: its text, its tool_use blocks as the turn's tool_calls, its
    thinking as the turn's reasoning_content."""
    text, calls, thinking = [], [], []
    for index, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text)
        elif block.type == "thinking":
            thinking.append(block.thinking)
        elif block.type == "redacted_thinking":
            continue
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            raise _misplaced(number, index, block.type, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": TEXT_JOINER.join(text)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = TEXT_JOINER.join(thinking)
    return message


def _text_message(role: str, text: list[str]) -> list[dict[str, Any]]:
    return [{"role": role, "content": TEXT_JOINER.join(text)}] if text else []


def _result_text(block) -> str:
    """A tool result's text; a failed call's (`is_error`) says so first, as the model cannot
    see the flag."""
    text = TEXT_JOINER.join(part.text for part in block.content)
    return f"Error: {text}" if block.is_error else text


def _misplaced(number: int, index: int, kind: str, role: str) -> InvalidRequestError:
    belongs = "user" if kind == "tool_result" else "assistant"
    return InvalidRequestError(f"messages.{number}.content.{index}: {kind} blocks go in "
                               f"{belongs} messages, not {role} ones", param="messages")
