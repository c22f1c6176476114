"""A Responses conversation (input items, earlier turns' output items) as the chat messages the
chat path renders, and a turn's output items as the input items a later turn continues from
(`previous_response_id`)."""

from __future__ import annotations

from typing import Any

from kvserve.entrypoints.openai.responses.protocol import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    joined,
)


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """Instructions first as a system message, then each item: a message as itself, function
    calls as the tool_calls of an assistant message (joined to the assistant text just before
    them: one turn of the model's), a call's output as a tool message. Reasoning becomes the
    reasoning_content of the assistant turn that follows it (which templates that read one
    render)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    thinking = []
    for item in items:
        if isinstance(item, ReasoningItem):
            thinking.append(item.text)
            continue
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": joined(item.content)})
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, {"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": joined(item.output)})
        if thinking and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "".join(thinking)
        thinking = [] if messages[-1]["role"] == "assistant" else thinking
    return messages


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def as_input_items(output: list[dict[str, Any]]) -> list[InputItem]:
    """A response's output items as the input items that continue from it."""
    items: list[InputItem] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append(MessageItem(role="assistant", content=text))
        elif item["type"] == "reasoning":
            items.append(ReasoningItem.model_validate(item))
        else:
            items.append(FunctionCallItem(call_id=item["call_id"], name=item["name"],
                                          arguments=item["arguments"]))
    return items

