"""`--eplb-config` / `LLM(eplb_config=...)`: vLLM's keys for EPLB (expert-parallel load
balancing), checked at start-up; a key we do not implement is an error naming it. Plain Python:
the API front-end reads engine options without torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvserve.options import json_option_text


@dataclass(frozen=True)
class EplbConfig:
    # steps between rebalances (vLLM's default)
    step_interval: int = 3000
    # the steps whose routed tokens a rebalance weighs: the ones since the previous rebalance
    # (so only the interval itself is accepted; vLLM's default window is 1000 steps of a
    # 3000-step interval, a sliding record we do not keep)
    window_size: int | None = None
    # extra copies of busy experts, spread over the expert-parallel ranks
    num_redundant_experts: int = 0
    log_balancedness: bool = False

    def __post_init__(self) -> None:
        if self.step_interval < 1:
            raise ValueError("eplb_config: step_interval must be >= 1")
        if self.num_redundant_experts < 0:
            raise ValueError("eplb_config: num_redundant_experts must be >= 0")
        if self.window_size is not None and self.window_size != self.step_interval:
            raise ValueError(
                f"eplb_config: window_size {self.window_size} differs from step_interval "
                f"{self.step_interval}: kvserve weighs the load since the previous rebalance "
                "(window_size = step_interval); leave window_size out or set them equal")


def parse_eplb_config(value: str | dict | None) -> EplbConfig:
    if value is None or value == "":
        return EplbConfig()
    raw: Any = json.loads(value) if isinstance(value, str) else dict(value)
    if not isinstance(raw, dict):
        raise ValueError(f"eplb_config must be a JSON object, got {value!r}")
    known = {field.name for field in fields(EplbConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"eplb_config: {', '.join(map(repr, unknown))} not implemented "
                         f"(known: {', '.join(sorted(known))})")
    return EplbConfig(**raw)


def eplb_config_text(value: str | dict | None) -> str | None:
    """The config as JSON text (EngineConfig keeps text: it crosses processes), checked."""
    return json_option_text(value, parse_eplb_config)
