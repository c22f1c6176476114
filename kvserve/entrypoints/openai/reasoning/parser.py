"""Where a reasoning model's thinking ends and its answer begins (`--reasoning-parser`, vLLM's
names). deepseek_r1 and qwen3 think in `<think>...</think>`: the thinking is the chat message's
`reasoning_content`, the rest is the answer, which the tool parser reads when tools were
offered. gpt_oss is harmony (../harmony.py), which a template that writes harmony gets without
the flag too. Without the flag a reply is all content, thinking included, as in vLLM.

Whether a reply starts inside its thinking is read off the rendered prompt (`thinking_plan`):
DeepSeek-R1 distills' templates end the prompt with `<think>\\n` (and deepseek_r1 assumes so
where the prompt says nothing, as vLLM's parser does), Qwen3's with a closed
`<think>\\n\\n</think>` when `enable_thinking` is false. Whole replies and streams go through
one state machine (`ReasoningStream`), which holds back a tail that may be the start of a
marker (a tag split across tokens), so neither field ever shows a piece of one and both ways
give the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.openai.harmony import speaks_harmony
from kvserve.entrypoints.openai.tools.parser import StreamingToolParser

DEEPSEEK_R1, QWEN3, GPT_OSS = "deepseek_r1", "qwen3", "gpt_oss"
THINK_TAG_PARSERS = (DEEPSEEK_R1, QWEN3)
PARSER_CHOICES = (*THINK_TAG_PARSERS, GPT_OSS)
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkingPlan:
    """How one reply is read: from inside its thinking (`inside`: the prompt opened it), or
    thinking only if it opens with <think>."""

    inside: bool


def uses_harmony(parser: str | None, chat_template: str | None) -> bool:
    """gpt_oss, or no parser named and a template that writes harmony (as before the flag)."""
    return parser == GPT_OSS or (parser is None and speaks_harmony(chat_template))


def thinking_plan(parser: str | None, prompt: str,
                  template_kwargs: dict[str, Any]) -> ThinkingPlan | None:
    """How this request's reply is read; None when it is all answer: no think-tag parser,
    `enable_thinking: false` (vLLM's rule), or a prompt that closed the thinking itself."""
    if parser not in THINK_TAG_PARSERS or template_kwargs.get("enable_thinking") is False:
        return None
    opened, closed = prompt.rfind(THINK_START), prompt.rfind(THINK_END)
    if opened > closed:
        return ThinkingPlan(inside=True)
    if closed >= 0 and prompt.rstrip().endswith(THINK_END):
        return None
    return ThinkingPlan(inside=parser == DEEPSEEK_R1)


def template_warnings(parser: str | None, chat_template: str | None) -> list[str]:
    """Why the chosen parser may not fit the model's chat template (logged at start)."""
    template = chat_template or ""
    if parser == GPT_OSS and not speaks_harmony(template):
        return ["--reasoning-parser gpt_oss: the chat template does not write harmony "
                "(<|channel|>, <|message|>); replies will not split into reasoning and content"]
    if parser not in THINK_TAG_PARSERS:
        return []
    if speaks_harmony(template):
        return [f"--reasoning-parser {parser}: the chat template writes harmony (gpt-oss); "
                "--reasoning-parser gpt_oss reads it"]
    if THINK_START not in template and THINK_END not in template:
        return [f"--reasoning-parser {parser}: the chat template never writes {THINK_START} "
                f"or {THINK_END}; the model may not think in them"]
    return []


def _held_back(text: str, marker: str) -> int:
    """How many of the text's last characters may be the beginning of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


@dataclass
class ReasoningStream:
    """One choice's stream: `feed(text so far, finished)` -> the deltas to send now, each
    {"reasoning_content": piece} or the answer's ({"content": piece}, or the tool parser's
    deltas when `answer` is one). Phases: "start" (may the reply open with <think>?),
    "thinking", "answer"."""

    plan: ThinkingPlan
    answer: StreamingToolParser | None = None  # reads the answer, when tools were offered
    phase: str = "start"
    _sent: int = 0  # how far the thinking went out
    answer_from: int = 0  # where the answer begins in the text
    _answer_sent: int = 0

    @property
    def called(self) -> bool:
        return self.answer is not None and self.answer.called

    def feed(self, text: str, finished: bool = False) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self.phase == "start":
            self._begin(text, finished)
        if self.phase == "thinking":
            deltas += self._thinking(text, finished)
        if self.phase == "answer":
            deltas += self._answer(text[self.answer_from:], finished)
        return deltas

    def _begin(self, text: str, finished: bool) -> None:
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            self.phase, self._sent = "thinking", len(text) - len(stripped) + len(THINK_START)
        elif THINK_START.startswith(stripped) and not finished:
            return  # it may still open with <think>
        elif self.plan.inside:
            self.phase = "thinking"
        else:
            self.phase = "answer"

    def _thinking(self, text: str, finished: bool) -> list[dict[str, Any]]:
        # a close cannot begin before `_sent`: what went out never ended in a piece of one
        end = text.find(THINK_END, self._sent)
        if end >= 0:
            piece = text[self._sent:end]
            self.phase, self.answer_from = "answer", end + len(THINK_END)
        else:
            upto = len(text) if finished else len(text) - _held_back(text, THINK_END)
            piece, self._sent = text[self._sent:upto], max(self._sent, upto)
        return [{"reasoning_content": piece}] if piece else []

    def _answer(self, text: str, finished: bool) -> list[dict[str, Any]]:
        if self.answer is not None:
            return self.answer.feed(text, finished)
        piece, self._answer_sent = text[self._answer_sent:], len(text)
        return [{"content": piece}] if piece else []


def split_reasoning(text: str, plan: ThinkingPlan) -> tuple[str | None, str | None]:
    """A finished reply as (reasoning, answer): None for a part it does not have (no thinking;
    an answer not begun when the reply ended inside its thinking)."""
    stream = ReasoningStream(plan)
    reasoning = "".join(delta.get("reasoning_content", "")
                        for delta in stream.feed(text, finished=True))
    answer = text[stream.answer_from:] if stream.phase == "answer" else None
    return reasoning or None, answer
