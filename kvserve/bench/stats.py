"""Latency statistics for a benchmark run: percentiles, throughput and goodput under SLOs.

Definitions (as in vLLM's serving benchmark): TTFT = first token - send; TPOT = (e2e - TTFT) /
(output tokens - 1) per request; ITL = gaps between consecutive streamed chunks; goodput =
requests per second that met every SLO given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, relative to the run start)."""

    sent: float
    first_token: float | None = None
    finished: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, as the server's usage counted them
    output_tokens: int = 0
    error: str | None = None
    output_text: str = ""
    turn: int | None = None  # multi-turn: the turn's index in its session

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def describe(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


@dataclass(frozen=True)
class SLO:
    """Limits in seconds; None means no limit on that metric."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        checks = ((self.ttft, result.ttft), (self.tpot, result.tpot), (self.e2e, result.e2e))
        return result.ok and all(limit is None or (value is not None and value <= limit)
                                 for limit, value in checks)


def summarize(results: list[RequestResult], duration: float, slo: SLO | None = None
              ) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    summary = {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else math.nan,
        "output_throughput": output_tokens / duration if duration else math.nan,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration
        if duration else math.nan,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "ttft_s": describe([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": describe([r.tpot for r in done if r.tpot is not None]),
        "itl_s": describe([gap for r in done for gap in r.itls]),
        "e2e_s": describe([r.e2e for r in done if r.e2e is not None]),
    }
    if slo is not None:
        good = sum(1 for r in results if slo.met_by(r))
        summary["goodput"] = good / duration if duration else math.nan
        summary["slo_attainment"] = good / len(results) if results else math.nan
    return summary
