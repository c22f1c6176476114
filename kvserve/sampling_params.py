"""SamplingParams: how to pick tokens and when to stop, compatible with vLLM's offline API.

Validation happens here, at construction, so a bad value is an InvalidRequestError before the
request ever reaches the engine loop.
"""

from __future__ import annotations

import copy
import enum
import json as _json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvserve.errors import InvalidRequestError

_GREEDY_EPSILON = 1e-5
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_LOGPROBS = 20


def _plain_data(value: Any) -> bool:
    """A dict with string keys that crosses to the engine's processes as msgpack."""
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        return False
    try:
        msgspec.msgpack.encode(value)
    except (TypeError, OverflowError, ValueError):
        return False
    return True


def fits_int64(value: int) -> bool:
    """Integers cross to the engine core as msgpack int64."""
    return -(2**63) <= value < 2**63 - MAX_N  # room for seed + sample index


@dataclass
class StructuredOutputsParams:
    """Constrained output, vLLM's names: exactly one of `json` (a JSON schema, as a dict or
    its text), `json_object` (any JSON object), `regex`, `choice` (one of these strings),
    `grammar` (EBNF/GBNF, or Lark) and `structural_tag` (xgrammar's JSON form). The front-end
    compiles it once to check it (kvserve/structured_output) and fills `key`; the sampling
    worker compiles it again from this text (xgrammar's serialized grammars are several times
    slower to write and read than to compile), cached by `key`."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    # filled by the front-end once the grammar compiled: its cache key
    key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)  # key order kept: it orders the output
        kinds = self.kinds()
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar and structural_tag; got {', '.join(kinds) or 'none'}",
                param="structured_outputs")
        checks = [
            (self.json is None or isinstance(self.json, str), "json must be a JSON schema"),
            (self.regex is None or isinstance(self.regex, str), "regex must be a string"),
            (self.grammar is None or isinstance(self.grammar, str), "grammar must be a string"),
            (self.choice is None or (isinstance(self.choice, list) and self.choice and all(
                isinstance(c, str) for c in self.choice)), "choice must be a non-empty list of "
             "strings"),
            (self.structural_tag is None or isinstance(self.structural_tag, str),
             "structural_tag must be a JSON string"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message, param="structured_outputs")

    def kinds(self) -> list[str]:
        return [name for name in ("json", "json_object", "regex", "choice", "grammar",
                                  "structural_tag") if getattr(self, name) not in (None, False)]


@dataclass
class ThinkingMarkers:
    """Where a reasoning model's thinking opens and closes, as token ids, and whether its
    reply starts inside it (the prompt opened it): what `thinking_token_budget` counts
    within and forces the close of. The server fills it from `--reasoning-parser`."""

    start_token_ids: list[int]
    end_token_ids: list[int]
    starts_inside: bool = False


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names): everything so far, only
    what is new since the previous output, or one output when the request finishes. A stream
    that forwards deltas takes DELTA, so no step copies a request's whole text, token ids and
    logprobs again (O(n^2) over a long answer); a caller that waits for the end takes
    FINAL_ONLY, so unfinished steps build no output at all."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # each prompt token's logprob (and this many alternatives) under the model, from the raw
    # logits of the position before it (vLLM's field); such a request skips the prefix cache,
    # so cached positions are recomputed, never missing
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # arguments for custom logits processors (vLLM's extra_args; `vllm_xargs` over HTTP)
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # at most this many tokens of thinking, then its close is forced (vLLM's field); needs
    # `thinking`, the markers it counts between
    thinking_token_budget: int | None = None
    thinking: ThinkingMarkers | None = None
    # the front-end's: what each RequestOutput carries (the core never reads it)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # filled by the engine: the model's EOS plus stop_token_ids
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.thinking, dict):
            self.thinking = ThinkingMarkers(**self.thinking)
        self._validate()

    def _validate(self) -> None:
        checks = [
            (isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}]"),
            (self.temperature >= 0, "temperature", "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be -1 (disabled), 0 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "frequency_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty",
             "repetition_penalty must be in (0, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop",
             f"at most {MAX_STOP_STRINGS} stop strings"),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "stop strings must be non-empty strings"),
            (all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
            (self.seed is None or fits_int64(self.seed), "seed", "seed must fit in 64 bits"),
            (self.extra_args is None or _plain_data(self.extra_args), "extra_args",
             "extra_args must be a dict with string keys and JSON-like values"),
            (self.thinking_token_budget is None or (
                self.thinking_token_budget >= 0 and self.thinking is not None
                and bool(self.thinking.end_token_ids)), "thinking_token_budget",
             "thinking_token_budget must be >= 0 and needs `thinking` (the token ids that open "
             "and close the thinking; the server fills them from --reasoning-parser)"),
            # once a grammar is complete only EOS may follow; min_tokens would forbid it too
            (self.structured_outputs is None or not self.min_tokens, "min_tokens",
             "min_tokens cannot be combined with structured output: the grammar decides where "
             "the output ends"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist."""
        thinking = self.thinking
        marker_ids = thinking.start_token_ids + thinking.end_token_ids if thinking else []
        if any(not 0 <= token_id < vocab_size for token_id in marker_ids):
            raise InvalidRequestError("thinking: a marker's token id is outside the "
                                      f"vocabulary [0, {vocab_size})", param="thinking")
        for token_id in list(self.logit_bias or {}) + self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                param = "logit_bias" if token_id in (self.logit_bias or {}) else "stop_token_ids"
                raise InvalidRequestError(
                    f"{param}: token id {token_id} is outside the vocabulary [0, {vocab_size})",
                    param=param)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
