"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's JSON keys, checked at start-up.
A key we do not implement is an error naming it, never ignored."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvserve.options import json_option_text

METHODS = ("ngram", "suffix", "draft_model", "mtp")
# vLLM's older name for a checkpoint's own MTP modules (DeepSeek's)
MTP_ALIASES = ("deepseek_mtp",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # suffix: defaults to suffix_decoding_max_tree_depth
    # ngram (prompt lookup): the shortest and longest suffix of the sequence looked up earlier
    # in it (vLLM's defaults: 5 and 5 when neither is given, else one gives the other)
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # suffix (SuffixDecoding; vLLM's keys and defaults): the longest match looked for, the
    # outputs of recent requests kept to match against, drafts per matched token, and the
    # least estimated probability of a whole draft
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: the draft model (a kvserve model reference: a short name, a GGUF file or an
    # HF directory) with the target's tokenizer, and its weights' quantization (default: the
    # target's)
    model: str | None = None
    quantization: str | None = None
    # mtp: the target checkpoint's own next-token-prediction modules (DeepSeek-V3's
    # num_nextn_predict_layers), run beside it in the worker; drafts past their count reuse them
    # our own: False keeps every proposed draft (no step-cost model); for measuring only
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not built (have: "
                             f"{', '.join(METHODS)})")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be >= 1")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: 'model' (the draft model) goes with method "
                             "'draft_model', and only with it")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max")


def mtp_module_count(num_nextn_predict_layers: int, num_speculative_tokens: int) -> int:
    """The modules the proposer loads: one per draft position up to the checkpoint's count
    (later drafts reuse them)."""
    return min(num_nextn_predict_layers, num_speculative_tokens)


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """The config from its JSON text (the CLI's) or dict (the LLM API's); None when off."""
    if value is None or value == "":
        return None
    try:
        raw: dict[str, Any] = json.loads(value) if isinstance(value, str) else dict(value)
    except ValueError as exc:
        raise ValueError(f"speculative_config is not a JSON object: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError("speculative_config must be a JSON object")
    known = {field.name for field in fields(SpeculativeConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"speculative_config: unsupported keys {unknown} (supported: "
                         f"{sorted(known)})")
    if raw.get("method") in MTP_ALIASES:
        raw["method"] = "mtp"
    if "model" in raw and "method" not in raw:  # as vLLM: a draft model names its method
        raw["method"] = "draft_model"
    if raw.get("method") == "suffix" and "num_speculative_tokens" not in raw:
        raw["num_speculative_tokens"] = raw.get("suffix_decoding_max_tree_depth", 24)
    if "method" not in raw or "num_speculative_tokens" not in raw:
        raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if low is None and high is not None:
        raw["prompt_lookup_min"] = high
    elif high is None and low is not None:
        raw["prompt_lookup_max"] = low
    return SpeculativeConfig(**raw)


def speculative_config_text(value: str | dict | None) -> str | None:
    """The config as JSON text (EngineConfig keeps text: it crosses processes), checked."""
    return json_option_text(value, parse_speculative_config)
