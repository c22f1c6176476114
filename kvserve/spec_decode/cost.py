"""How many drafts a step carries, from what a step costs on this machine.

Verifying k drafts costs the step the time of k more tokens in the batch; it pays when the
tokens they are expected to add outweigh that. `StepCostModel` holds the step time by tokens in
the batch, profiled at start-up and kept current from the steps the engine runs (so it follows
this machine, its load and the batch mix, with no per-deployment table); `allocate_drafts`
takes drafts best expected gain first and keeps as many as give the most tokens per second.
At high batch or low acceptance no draft pays, and speculation backs off by itself.

Step time has two parts: what grows with the tokens in the batch (the weights' GEMMs, the
logits), and attention, which grows with each query token's context. The curve holds the first
(measured on one-token contexts); `read_seconds` prices the second, per query token and token of
context it attends over. Without it a verification at a long context looked as cheap as one at
a short one: at s3 (8 requests over 1,100-token contexts, Zen 4) the decode batch's own size
read 16.5 ms where the profile's larger sizes read 17.9 ms at 16 tokens, so 8 drafts looked
nearly free and cost 30 ms a step (attention alone ~1.4 us a query and context token over the
30 layers, half of a batch-8 step at 1,024 tokens of context)."""

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
LOOKAHEAD = 8  # drafts allocate_drafts tries past the last allocation that paid
# the rising fit is redone after this many steps (or a new size): 10-30 us a fit, 0.2% of a
# single-stream step if done on each; a curve a few steps behind decides the same drafts
REFIT_EVERY = 8
# Sequences with fewer new tokens than this are priced by their attention reads (decodes and
# verifications, each query row scored against the whole context: the paged kernel, or flash
# from 4 new tokens in bf16, priced alike since the start-up profile times verification-shaped
# steps); longer prompt chunks' attention stays in the curve at their sizes.
READS_MAX_NEW_TOKENS = 16


def attention_reads(num_new_tokens: int, seq_len: int) -> int:
    """(query token, context token) pairs a sequence's attention reads in a step, as priced by
    `StepCostModel.read_seconds` (0 for long prompt chunks: see READS_MAX_NEW_TOKENS)."""
    return num_new_tokens * seq_len if num_new_tokens < READS_MAX_NEW_TOKENS else 0


class StepCostModel:
    def __init__(self, points: dict[int, float] | None = None, read_seconds: float = 0.0):
        # seconds a step spends per attention read (`attention_reads`): profiled at start-up
        self.read_seconds = read_seconds
        self._times: dict[int, deque[float]] = {}
        self._sizes: list[int] = []
        self._seconds: list[float] = []  # each size's median
        self._fitted: list[float] = []  # the medians made to rise (`cost` reads these)
        self._unfitted = 0  # steps observed since the last fit
        for size, seconds in sorted((points or {}).items()):
            self.observe(size, seconds)

    @property
    def measured(self) -> bool:
        return len(self._sizes) >= 2

    def observe(self, num_tokens: int, seconds: float, reads: int = 0) -> None:
        """A step of `num_tokens` tokens and `reads` attention reads took `seconds`: the curve
        keeps the time less the reads' (exact sizes up to 64, then powers of two: a step's
        size class)."""
        # a tenth of the step at least: a read price a little high never makes a size free
        seconds = max(seconds - self.read_seconds * reads, 0.1 * seconds)
        size = _size_class(num_tokens)
        times = self._times.get(size)
        if times is None:
            times = self._times[size] = deque(maxlen=WINDOW)
            index = bisect.bisect_left(self._sizes, size)
            self._sizes.insert(index, size)
            self._seconds.insert(index, seconds)
        times.append(seconds)
        self._seconds[self._sizes.index(size)] = statistics.median(times)
        self._unfitted += 1
        if self._unfitted >= REFIT_EVERY or len(self._fitted) != len(self._sizes):
            self._fitted = _rising(self._sizes, self._seconds)
            self._unfitted = 0

    def cost(self, num_tokens: int, reads: int = 0) -> float:
        """Step seconds at `num_tokens` tokens and `reads` attention reads: the curve's part
        linear between measured sizes on a rising fit of their medians (`_rising`), the end
        slopes beyond them."""
        return self._curve(num_tokens) + self.read_seconds * reads

    def _curve(self, num_tokens: int) -> float:
        sizes, fitted = self._sizes, self._fitted
        if not sizes:
            return float(num_tokens)
        if len(sizes) == 1:
            return fitted[0] * num_tokens / sizes[0]
        index = min(max(bisect.bisect_left(sizes, num_tokens), 1), len(sizes) - 1)
        x0, x1, y0, y1 = sizes[index - 1], sizes[index], fitted[index - 1], fitted[index]
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        return max(1e-9, y0 + slope * (num_tokens - x0))

    def points(self) -> dict[int, float]:
        """The current estimate per size class, before the fit (for logs and tests)."""
        return dict(zip(self._sizes, self._seconds))


def _rising(sizes: list[int], seconds: list[float]) -> list[float]:
    """Step times by size made to rise: the least-squares non-decreasing fit, then each step at
    least half the average slope above the one before (a token more never costs nothing).
    Sizes a batch seldom hits keep their start-up times while the sizes around them are
    measured under load: with s12's 64 requests at once the medians read 56.6 ms at 28 tokens
    and 39.4 at 32, so drafts between them looked free and the proposer ran on every step."""
    fitted = _non_decreasing(seconds)
    if len(sizes) < 2:
        return fitted
    least = 0.5 * max(0.0, fitted[-1] - fitted[0]) / (sizes[-1] - sizes[0])
    for index in range(1, len(fitted)):
        fitted[index] = max(fitted[index],
                            fitted[index - 1] + least * (sizes[index] - sizes[index - 1]))
    return fitted


def _non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count], means increasing
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count),
                          blocks[-1][1] + count]
    return [mean for mean, count in blocks for _ in range(int(count))]


def _size_class(num_tokens: int) -> int:
    return num_tokens if num_tokens <= 64 else 1 << (num_tokens - 1).bit_length()


def allocate_drafts(base_tokens: int, gains: dict[Hashable, Sequence[float]],
                    cost: StepCostModel, draft_token_seconds: float = 0.0, base_reads: int = 0,
                    draft_reads: dict[Hashable, int] | None = None) -> dict[Hashable, int]:
    """Drafts per request. `base_tokens`, `base_reads`: the step's tokens and attention reads
    without drafts; `gains[key][j]`: the expected tokens the request's (j+1)-th draft adds (its
    acceptance to the power j+1); `draft_reads[key]`: the reads one draft of the request adds
    (its context); `draft_token_seconds`: what making one draft costs (a draft model's forward
    share; context drafts are free). Each step emits one token per request plus the accepted
    drafts.

    Drafts are taken best expected gain first, and the allocation kept is the one with the
    most expected tokens per second of step time (drafting included), a larger one kept only
    where it beats the last kept by more than MIN_GAIN for each draft it adds. The walk goes
    LOOKAHEAD drafts past the last kept: a step-cost curve is not convex (a kernel's row
    blocking, a noisy profile point), and a draft that does not pay alone can open the way to
    several that do. Stopping at the first draft that did not pay, a 2-token step profiled
    at 1.56x a 1-token step (AVX2, Zen 4) left single streams without drafts for good, where
    4 drafts paid."""
    keys = list(gains)
    counts = dict.fromkeys(keys, 0)
    # (-gain, request's index, draft index): ties go to the earlier request, never compare keys
    heap = [(-gains[key][0], n, 0) for n, key in enumerate(keys) if gains[key]]
    heapq.heapify(heap)
    taken: list[int] = []  # request indices, in the order their drafts were taken
    tokens, reads, expected, drafting = base_tokens, base_reads, float(len(gains)), 0.0
    best_rate, kept = expected / (cost.cost(tokens, reads) + drafting), 0
    while heap and len(taken) - kept < LOOKAHEAD:
        negative_gain, n, j = heapq.heappop(heap)
        taken.append(n)
        expected -= negative_gain
        tokens += 1
        reads += draft_reads[keys[n]] if draft_reads else 0
        drafting += draft_token_seconds
        rate = expected / (cost.cost(tokens, reads) + drafting)
        if _pays(rate, best_rate, len(taken) - kept):
            best_rate, kept = rate, len(taken)
        if j + 1 < len(gains[keys[n]]):
            heapq.heappush(heap, (-gains[keys[n]][j + 1], n, j + 1))
    for n in taken[:kept]:
        counts[keys[n]] += 1
    return counts


def a_draft_can_pay(num_requests: int, base_tokens: int, cost: StepCostModel,
                    base_reads: int = 0, draft_reads: int = 0) -> bool:
    """Whether drafts sure to be accepted (up to LOOKAHEAD of them, as far as
    `allocate_drafts` looks), each adding `draft_reads` attention reads (the shortest context
    among the requests), would pass its test for a step of `base_tokens` tokens and
    `num_requests` requests in decode: when not, no proposal can get a draft, and the
    proposer's work (~50 us a request for suffix drafts) can be skipped."""
    rate = num_requests / cost.cost(base_tokens, base_reads)
    return any(_pays((num_requests + k) / cost.cost(base_tokens + k, base_reads + k * draft_reads),
                     rate, k)
               for k in range(1, LOOKAHEAD + 1))


def _pays(rate: float, best_rate: float, num_drafts: int) -> bool:
    """Whether `num_drafts` more drafts giving expected tokens per second `rate` beat
    `best_rate` by more than MIN_GAIN a draft (what the curve does not see grows with the
    drafts: their rows of logits and their sampling)."""
    return rate > (1 + MIN_GAIN) ** num_drafts * best_rate
