"""Whether loading a run of blocks from a tier beats recomputing them, from this engine's own
timings (no constants measured on one machine).

A load is asynchronous: the request sits out at least the step during which its blocks are read,
and a slow tier (a disk, a network mount) adds reading time on top; the other requests run on.
A recompute puts the run's tokens into the current step, which every running request waits on.
So loading n blocks costs one request about a step plus n times the reading time per block past
that step, and recomputing them costs n x block_size prefill tokens' time for each of the
step's requests. A busy engine loads (recomputing would slow every stream); an idle one with a
fast prefill and a slow tier recomputes short runs. The rates are exponential moving averages
of what the scheduler sees: the wall time between consecutive schedules of a busy engine (a
step), the same per token for prefill-heavy steps, and each finished load's latency.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest sample
BUSY_GAP_S = 2.0  # longer between schedules: the engine idled, not a step
PREFILL_SAMPLE_TOKENS = 64  # a step with at least this many tokens is a prefill sample


def _ewma(current: float | None, sample: float) -> float:
    return sample if current is None else current + SMOOTHING * (sample - current)


@dataclass
class LoadCost:
    step_s: float | None = None  # a busy step's wall time
    prefill_token_s: float | None = None  # per token of a prefill-heavy step
    read_block_s: float = 0.0  # a load's reading time past one step, per block
    batch: int = 1  # requests in the latest step: who waits on a recompute
    _last_schedule_at: float | None = None
    _last_tokens: int = 0

    def on_schedule(self, now: float, tokens: int, requests: int) -> None:
        """A step was scheduled at `now` with `tokens` new tokens for `requests` requests; the
        time since the last schedule is the last step's."""
        last = self._last_schedule_at
        if last is not None and self._last_tokens and now - last < BUSY_GAP_S:
            elapsed = now - last
            self.step_s = _ewma(self.step_s, elapsed)
            if self._last_tokens >= PREFILL_SAMPLE_TOKENS:
                self.prefill_token_s = _ewma(self.prefill_token_s, elapsed / self._last_tokens)
        self._last_schedule_at, self._last_tokens = now, tokens
        self.batch = max(1, requests)

    def on_load(self, blocks: int, seconds: float) -> None:
        """A load of `blocks` blocks finished `seconds` after it was issued."""
        if blocks > 0:
            beyond_a_step = max(0.0, seconds - (self.step_s or 0.0))
            self.read_block_s = _ewma(self.read_block_s, beyond_a_step / blocks)

    def load_pays(self, blocks: int, block_size: int) -> bool:
        """Loading `blocks` is expected to be faster than recomputing them. Until both rates
        are measured, yes: every machine measured so far loads far faster than it prefills
        (docs/performance-journal.md)."""
        if self.step_s is None or self.prefill_token_s is None:
            return True
        load_s = self.step_s + blocks * self.read_block_s
        return load_s < blocks * block_size * self.prefill_token_s * self.batch
