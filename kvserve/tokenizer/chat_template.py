"""Render chat templates with jinja2 exactly as HF transformers does.

Same sandboxed environment (trim_blocks, lstrip_blocks, loopcontrols), the same `tojson` filter and
globals (`raise_exception`, `strftime_now`), and `{% generation %}` blocks rendered as plain text.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.errors import InvalidRequestError


class TemplateError(InvalidRequestError):
    """The chat template rejected the conversation (it called raise_exception)."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; when
    rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise TemplateError(f"chat template error: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` to the prompt text the model expects."""
    try:
        template = compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the model's chat template does not compile: {exc}") from exc
    context = dict(special_tokens or {})
    context.update(extra)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **context)
    except TemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as exc:
        raise TemplateError(f"the conversation does not fit the chat template: {exc}") from exc
