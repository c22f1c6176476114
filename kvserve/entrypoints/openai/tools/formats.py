"""The tool-call formats a model may speak, by vLLM's `--tool-call-parser` names, and how a
model's format is chosen when the flag is left to `auto`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str  # vLLM's parser name
    xgrammar_model: str  # the format's name in xgrammar.get_model_structural_tag
    begin: str  # what opens one call in the output
    end: str  # what closes it
    arguments_key: str  # the call object's key for the arguments


HERMES = ToolFormat("hermes", "qwen_3", "<tool_call>", "</tool_call>", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "llama", "", "", "parameters")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}
PARSER_CHOICES = ("auto", *FORMATS)


def choose_format(parser: str, chat_template: str | None) -> ToolFormat:
    """`--tool-call-parser`: a named format, or `auto`: Llama 3's JSON format where the model's
    template speaks it, else Hermes' `<tool_call>` tags (what Qwen 2/3 and Hermes templates
    use, and what kvserve's default tool prompt teaches a model whose template has no tools)."""
    if parser != "auto":
        return FORMATS[parser]
    template = chat_template or ""
    if "<|python_tag|>" in template or ("tools" in template and "parameters" in template
                                        and "<tool_call>" not in template):
        return LLAMA3_JSON
    return HERMES


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether the chat template renders a `tools` list itself."""
    return bool(chat_template) and "tools" in chat_template
