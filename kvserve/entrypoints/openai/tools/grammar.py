"""The grammar a tool request's output follows, as an xgrammar structural tag: with `auto`,
free text in which any call the model starts is a valid call of an offered tool; with
`required`, nothing but calls (one, or several with parallel_tool_calls); with a named
function, exactly one call of it. Every call's arguments follow the tool's parameters
schema, so a call always parses."""

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
