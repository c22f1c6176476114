"""The grammar a tool request's output follows, as an xgrammar structural tag: with `auto`,
free text in which any call the model starts is a valid call of an offered tool; with
`required`, nothing but calls (one, or several with parallel_tool_calls); with a named
function, exactly one call of it. Every call's arguments follow the tool's parameters
schema, so a call always parses. gpt-oss's harmony turns get their own (`harmony_call_tag`)."""

from __future__ import annotations

import json
from typing import Any

from kvserve.entrypoints.openai.tools.formats import ToolFormat
from kvserve.structured_output.backend import xgrammar

CALL_SEPARATOR = "\n"


def tool_structural_tag(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                        parallel: bool, tool_format: ToolFormat) -> str:
    """The structural tag (xgrammar's JSON form) for this choice of tools."""
    tag = xgrammar().get_model_structural_tag(
        tool_format.xgrammar_model, tools=[_with_parameters(t) for t in tools],
        tool_choice=tool_choice, reasoning=False, parallel_tool_calls=parallel)
    data = json.loads(tag.model_dump_json())
    form = data["format"]
    if tool_choice == "required" and form["type"] == "triggered_tags":
        # xgrammar's `required` still lets free text come first (it only forbids ending
        # without a call); a small model then writes prose until max_tokens: calls only
        tags = form["tags"]
        data["format"] = ({"type": "tags_with_separator", "tags": tags,
                           "separator": CALL_SEPARATOR, "at_least_one": True,
                           "stop_after_first": False}
                          if parallel else {"type": "or", "elements": tags})
    return json.dumps(data)


def _with_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool without a parameters schema takes any object (OpenAI's default)."""
    function = tool["function"]
    if function.get("parameters"):
        return tool
    return {**tool, "function": {**function, "parameters": {"type": "object"}}}


# gpt-oss (harmony): a message after the first opens with this (the prompt opens the first)
HARMONY_SEPARATOR = "<|start|>assistant"


def harmony_call_tag(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> str:
    """gpt-oss's turn when a call is required (tool_choice "required", or a named function):
    analysis messages if the model reasons first, then one call of an offered tool (or of the
    named one) whose arguments follow its schema. The call's <|call|> ends the turn (a stop
    token), so harmony makes one call a turn whatever parallel_tool_calls says."""
    chosen = [tool for tool in tools if tool_choice == "required"
              or tool["function"]["name"] == tool_choice["function"]["name"]]
    call = {"type": "or", "elements": [tag for tool in chosen
                                       for tag in _harmony_call_tags(_with_parameters(tool))]}
    analysis = {"type": "tag", "begin": "<|channel|>analysis<|message|>",
                "content": {"type": "any_text"}, "end": "<|end|>"}
    reasoned_call = {"type": "sequence", "elements": [
        {"type": "tags_with_separator", "tags": [analysis], "separator": HARMONY_SEPARATOR,
         "at_least_one": True},
        {"type": "const_string", "value": HARMONY_SEPARATOR}, call]}
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "or", "elements": [call, reasoned_call]}})


def _harmony_call_tags(tool: dict[str, Any]) -> list[dict[str, Any]]:
    """A call's headers as gpt-oss writes them: the channel first (OpenAI's harmony guide), or
    the recipient first (how its chat template renders past calls)."""
    function = tool["function"]
    arguments = {"type": "json_schema", "json_schema": function["parameters"]}
    recipient = f"to=functions.{function['name']}"
    return [{"type": "tag", "begin": begin, "content": arguments, "end": "<|call|>"} for begin in (
        f"<|channel|>commentary {recipient} <|constrain|>json<|message|>",
        f" {recipient}<|channel|>commentary <|constrain|>json<|message|>",
        f" {recipient}<|channel|>commentary json<|message|>")]
