"""How many drafts a step carries, from what a step costs on this machine.

Verifying k drafts costs the step the time of k more tokens in the batch; it pays when the
tokens they are expected to add outweigh that. `StepCostModel` holds the step time by tokens in
the batch, profiled at start-up and kept current from the steps the engine runs (so it follows
this machine, its load and the batch mix, with no per-deployment table); `allocate_drafts`
hands out drafts one at a time, best expected gain first, while tokens per second still rise.
At high batch or low acceptance the next draft never pays, and speculation backs off by
itself."""

from __future__ import annotations

import bisect
import heapq
import statistics
from collections import deque
from collections.abc import Hashable, Sequence

WINDOW = 15  # a size's estimate: the median of its last this many steps (one-off stalls and
# first calls of a shape do not move it)
# A draft is added only while it raises expected tokens per second by more than this fraction.
# What the curve does not see costs a few percent at batch: in the server the front-end and
# the client share the cores, and a draft's row of logits and its sampling. At 16 requests the
# curve said 96%-accepted drafts paid by ~0.5% and the server measured -7% (s8, Zen 4); the
# issue's bar is "never more than 2% slower". Single streams, where a draft pays 10-70%, do not
# notice it.
MIN_GAIN = 0.02


class StepCostModel:
    def __init__(self, points: dict[int, float] | None = None):
        self._times: dict[int, deque[float]] = {}
        self._sizes: list[int] = []
        self._seconds: list[float] = []
        for size, seconds in sorted((points or {}).items()):
            self.observe(size, seconds)

    @property
    def measured(self) -> bool:
        return len(self._sizes) >= 2

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` tokens took `seconds` (exact sizes up to 64, then powers of
        two: a step's size class)."""
        size = _size_class(num_tokens)
        times = self._times.get(size)
        if times is None:
            times = self._times[size] = deque(maxlen=WINDOW)
            index = bisect.bisect_left(self._sizes, size)
            self._sizes.insert(index, size)
            self._seconds.insert(index, seconds)
        times.append(seconds)
        self._seconds[self._sizes.index(size)] = statistics.median(times)

    def cost(self, num_tokens: int) -> float:
        """Step seconds at `num_tokens`, linear between measured sizes, the end slopes beyond
        them (never decreasing with size)."""
        sizes, seconds = self._sizes, self._seconds
        if not sizes:
            return float(num_tokens)
        if len(sizes) == 1:
            return seconds[0] * num_tokens / sizes[0]
        index = min(max(bisect.bisect_left(sizes, num_tokens), 1), len(sizes) - 1)
        x0, x1, y0, y1 = sizes[index - 1], sizes[index], seconds[index - 1], seconds[index]
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        return max(1e-9, y0 + slope * (num_tokens - x0))

    def points(self) -> dict[int, float]:
        """The current estimate per size class (for logs and tests)."""
        return dict(zip(self._sizes, self._seconds))


def _size_class(num_tokens: int) -> int:
    return num_tokens if num_tokens <= 64 else 1 << (num_tokens - 1).bit_length()


def allocate_drafts(base_tokens: int, gains: dict[Hashable, Sequence[float]],
                    cost: StepCostModel, draft_token_seconds: float = 0.0) -> dict[Hashable, int]:
    """Drafts per request. `base_tokens`: the step's tokens without drafts; `gains[key][j]`:
    the expected tokens the request's (j+1)-th draft adds (its acceptance to the power j+1);
    `draft_token_seconds`: what making one draft costs (a draft model's forward share; context
    drafts are free). Each step emits one token per request plus the accepted drafts; a draft
    is added while expected tokens per second of step time (drafting included) rise by more
    than MIN_GAIN."""
    keys = list(gains)
    counts = dict.fromkeys(keys, 0)
    # (-gain, request's index, draft index): ties go to the earlier request, never compare keys
    heap = [(-gains[key][0], n, 0) for n, key in enumerate(keys) if gains[key]]
    heapq.heapify(heap)
    tokens, expected, drafting = base_tokens, float(len(gains)), 0.0
    while heap:
        negative_gain, n, j = heapq.heappop(heap)
        gain, key = -negative_gain, keys[n]
        if not _raises_rate(expected, gain, cost.cost(tokens) + drafting,
                            cost.cost(tokens + 1) + drafting + draft_token_seconds):
            break
        counts[key] = j + 1
        expected += gain
        tokens += 1
        drafting += draft_token_seconds
        if j + 1 < len(gains[key]):
            heapq.heappush(heap, (-gains[key][j + 1], n, j + 1))
    return counts


def a_draft_can_pay(num_requests: int, base_tokens: int, cost: StepCostModel) -> bool:
    """Whether a draft sure to be accepted would pass `allocate_drafts`' test for a step of
    `base_tokens` tokens and `num_requests` requests in decode: when not, no proposal can get
    a draft, and the proposer's work (~50 us a request for suffix drafts) can be skipped."""
    return _raises_rate(num_requests, 1.0, cost.cost(base_tokens), cost.cost(base_tokens + 1))


def _raises_rate(expected: float, gain: float, seconds: float, seconds_after: float) -> bool:
    """Whether `gain` more expected tokens for a step taking `seconds_after` instead of
    `seconds` raise tokens per second by more than MIN_GAIN."""
    return (expected + gain) * seconds > (1 + MIN_GAIN) * expected * seconds_after
