"""The conversation as the chat template receives it when tools are offered: the template's own
tool support where it has one, else kvserve's default prompt (docs/architecture.md, "Structured
output and tool calling"): a system message listing the tools in Hermes' format, earlier calls
written back as `<tool_call>` blocks and tool results as user turns in `<tool_response>` blocks
(templates such as Gemma's accept only alternating user and assistant turns)."""

from __future__ import annotations

import json
from typing import Any

from kvserve.entrypoints.openai.tools.formats import ToolFormat

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                      tool_format: ToolFormat, template_takes_tools: bool
                      ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for a request that offers `tools`."""
    if template_takes_tools:
        return [for_template(m) for m in messages], {"tools": tools}
    system = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    rendered: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if rendered and rendered[-1]["role"] == "user" and rendered[-1].get("_tool"):
                rendered[-1]["content"] += "\n" + block  # several results: one user turn
            else:
                rendered.append({"role": "user", "content": block, "_tool": True})
        elif role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_block(call, tool_format) for call in message["tool_calls"])
            text = message.get("content") or ""
            rendered.append({"role": "assistant", "content": f"{text}\n{calls}".strip()})
        else:
            rendered.append(dict(message))
    for message in rendered:
        message.pop("_tool", None)
    if rendered and rendered[0]["role"] == "system":
        rendered[0]["content"] = f"{rendered[0]['content']}\n\n{system}"
    else:
        rendered.insert(0, {"role": "system", "content": system})
    return rendered, {}


def _call_block(call: dict[str, Any], tool_format: ToolFormat) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"],
                       tool_format.arguments_key: _arguments(function.get("arguments"))})
    return f"{tool_format.begin}\n{body}\n{tool_format.end}" if tool_format.begin else body


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face templates read a call's arguments as a mapping."""
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"],
                                   "arguments": _arguments(call["function"].get("arguments"))}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}
