"""The request's `thinking` as the chat path's switches: "enabled" (with budget_tokens, the chat
path's thinking_token_budget) and "adaptive" (the model decides how long) turn the thinking on
in the template (`enable_thinking`, which Qwen3's and the R1 distills' templates read);
"disabled" turns it off there and sends no thinking blocks. Thinking needs a server that splits
a reply's thinking from its answer (--reasoning-parser, or a harmony template).

Anthropic's own API also wants budget_tokens >= 1024; that floor is not enforced here (small
local models think in far fewer tokens, and vLLM does not enforce it either), but a budget must
leave room for the answer: budget_tokens < max_tokens, as Anthropic checks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvserve.errors import InvalidRequestError


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)
    # "summarized" is what this server does: the thinking as the model wrote it
    display: Literal["summarized", "omitted"] | None = None

    @field_validator("display")
    @classmethod
    def _shown(cls, value):
        if value == "omitted":
            raise PydanticCustomError(
                "not_implemented", 'display "omitted" is not supported by this server: '
                'thinking blocks carry the thinking; leave display out or send "summarized"')
        return value

    @model_validator(mode="after")
    def _budget_with_enabled(self):
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('budget_tokens is needed with type "enabled", and only with it')
        return self

    @property
    def on(self) -> bool:
        return self.type != "disabled"

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields that ask for this: the template switch, the budget, and
        (disabled) no reasoning shown, for models that think regardless (gpt-oss)."""
        return {"chat_template_kwargs": {"enable_thinking": self.on},
                "thinking_token_budget": self.budget_tokens, "include_reasoning": self.on}


def check_budget(thinking: ThinkingConfig | None, max_tokens: int) -> None:
    """Anthropic's rule: the thinking counts toward max_tokens, so its budget must be less."""
    if thinking is not None and thinking.budget_tokens is not None \
            and thinking.budget_tokens >= max_tokens:
        raise PydanticCustomError(
            "value_error", "thinking.budget_tokens ({budget}) must be less than max_tokens "
            "({max_tokens}): the thinking counts toward max_tokens",
            {"budget": thinking.budget_tokens, "max_tokens": max_tokens})


def check_server_thinks(thinking: ThinkingConfig | None, splits_reasoning: bool) -> None:
    """A 400 for thinking asked of a server that cannot tell thinking from answer."""
    if thinking is not None and thinking.on and not splits_reasoning:
        raise InvalidRequestError(
            f'thinking ({{"type": "{thinking.type}"}}) needs a server started with '
            "--reasoning-parser (deepseek_r1, qwen3 or gpt_oss): without one a reply's "
            'thinking is not told from its answer; leave thinking out or send '
            '{"type": "disabled"}', param="thinking")
