"""Token sampling for a batch of rows, each with its own SamplingParams.

Order, as in vLLM: the logits processors that can change a greedy choice (logit_bias, min_tokens,
penalties, then custom ones), then greedy argmax, or temperature -> top-k -> top-p -> the
argmax-invariant processors (min_p, then custom ones) -> a draw. Seeded rows draw from their own
torch.Generator, so the same seed gives the same tokens whatever else is in the batch. Logprobs
are of the raw model logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from kvserve.protocol.worker import TokenLogprobs
from kvserve.sample.builtin_processors import builtin_processors
from kvserve.sample.logits_processor import AddedRow, BatchUpdate, LogitsProcessor
from kvserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0, argmax_rows=None,
                 logits_processors: Sequence[LogitsProcessor] = ()):
        """`logits_processors`: custom ones, run after the built-ins of their kind."""
        self.default_generator = torch.Generator().manual_seed(seed)
        # the compiled kernel when the runner has one (torch's CPU argmax is slow on [B, 49k])
        self.argmax_rows = argmax_rows or (lambda logits: logits.argmax(dim=-1))
        self.processors = [*builtin_processors(), *logits_processors]
        self._num_rows = 0  # the batch's size, as the processors know it

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 batch_update: BatchUpdate | None = None) -> SamplerOutput:
        """`rows` in the persistent batch's order, and its changes since the last call
        (`batch_update`, empty when none); without one the rows are a batch of their own."""
        self._update_processors(rows, batch_update)
        logits = logits.float().cpu()
        raw_logprobs = None
        if any(row.params.logprobs is not None for row in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processors = self._active(argmax_invariant=False)
        if processors:
            logits = _run(processors, logits.clone())  # they may write in place
        token_ids = self._choose(logits, rows)
        logprobs = [
            _token_logprobs(raw_logprobs[i], token_ids[i], row.params.logprobs)
            if raw_logprobs is not None and row.params.logprobs is not None else None
            for i, row in enumerate(rows)
        ]
        return SamplerOutput(token_ids, logprobs)

    def _update_processors(self, rows: list[SamplingRow], batch_update: BatchUpdate | None):
        if batch_update is None:
            batch_update = BatchUpdate(len(rows), range(self._num_rows), [
                AddedRow(i, row.params, row.prompt_token_ids, row.output_token_ids)
                for i, row in enumerate(rows)])
        if batch_update.batch_size != len(rows):
            raise ValueError(f"the batch update is for {batch_update.batch_size} rows, the "
                             f"step has {len(rows)}")
        self._num_rows = batch_update.batch_size
        change = None if batch_update.empty else batch_update
        for processor in self.processors:
            processor.update_state(change)

    def _active(self, argmax_invariant: bool) -> list[LogitsProcessor]:
        return [p for p in self.processors
                if p.is_argmax_invariant() == argmax_invariant and p.is_active()]

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        chosen = self.argmax_rows(logits.contiguous())
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            probs = self._random_probs(logits, random_rows, [rows[i].params for i in random_rows])
            noise = self._exponential_noise(probs.shape, [rows[i] for i in random_rows])
            chosen[random_rows] = (probs / noise).argmax(dim=-1)
        return chosen.tolist()

    def _random_probs(self, logits: torch.Tensor, random_rows: list[int],
                      params: list[SamplingParams]) -> torch.Tensor:
        """The random rows' distributions: temperature, top-k/top-p, then the argmax-invariant
        processors. Those index the whole batch, so a batch that also has greedy rows is
        handed over whole (its greedy rows are chosen already, and untouched by design)."""
        everything = len(random_rows) == logits.shape[0]
        filtered = _filtered_logits(logits if everything else logits[random_rows], params)
        processors = self._active(argmax_invariant=True)
        if processors and everything:
            filtered = _run(processors, filtered)
        elif processors:
            index = torch.tensor(random_rows)
            filtered = _run(processors, logits.index_put((index,), filtered))[index]
        return torch.softmax(filtered, dim=-1)

    def _exponential_noise(self, shape, rows: list[SamplingRow]) -> torch.Tensor:
        """argmax(p / E) with E ~ Exp(1) is a draw from p (the Gumbel-max trick in disguise)."""
        noise = torch.empty(shape)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=row.generator or self.default_generator)
        return noise


def _run(processors: list[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
    for processor in processors:
        logits = processor.apply(logits)
    return logits


def _filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then -inf outside each row's top-k and top-p (a new tensor)."""
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits


# Top-p first looks at this many of a row's best tokens: with a trained model's logits the
# nucleus almost always fits, and torch.topk of a few hundred is ~30x cheaper than a sort of 49k.
_FIRST_WINDOW = 256
# A window settles a row only when its mass clears top_p by this much, so that no token past the
# window can round back under top_p (the sums are float64: their error is ~1e-16 x the vocab).
_MASS_SLACK = 1e-9
# The histogram that sizes the second window: buckets of logit distance below the row's best.
_BUCKETS = 1024
_BUCKET_SPAN = 40.0  # the last bucket takes everything further down, tokens of < e^-40 of the best


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """-inf outside each row's top_k best logits and then outside the shortest run of its best
    tokens whose probability reaches top_p; ties at a cut keep the lowest token ids.

    The tokens a sort of each row keeps (tests/test_sampler.py holds that reference), without the
    sort: sorting 49k logits costs ~3 ms a row, half a batch-1 decode step, and ~23 ms at 262k.
    top_p = 1.0 keeps every token; so did the sort, except when another row of the batch filtered
    and the float32 running sum rounded past 1.0 before the end of the row.
    """
    vocab = logits.shape[-1]
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k])
    p = torch.tensor(top_p).double()  # rounded to float32 first, as the sort compared it
    logits = _on_rows(logits, k < vocab, lambda rows: _keep_top_k(logits[rows], k[rows], p[rows]))
    return _on_rows(logits, (p < 1.0) & (k == vocab),
                    lambda rows: _keep_top_p(logits[rows], p[rows]))


def _on_rows(logits: torch.Tensor, which: torch.Tensor,
             keep: Callable[[torch.Tensor | slice], torch.Tensor]) -> torch.Tensor:
    """`keep(rows)` for the rows `which` selects, written back; no copies when that is all rows."""
    if bool(which.all()):
        return keep(slice(None))
    rows = which.nonzero().flatten()
    return logits.index_put((rows,), keep(rows)) if len(rows) else logits


def _keep_top_k(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """torch.topk finds each row's k best, in order: the k-th is the cut (the next one shows a tie
    at it), and a row's top-p nucleus lies among them, so it needs no pass over the vocabulary."""
    values = logits.topk(int(k.max()) + 1, dim=-1).values
    k = k.unsqueeze(1)
    if bool((top_p < 1.0).any()):
        ranks = torch.arange(values.shape[-1] - 1).unsqueeze(0)
        best = values[:, :-1].masked_fill(ranks >= k, float("-inf")).double()
        mass = torch.softmax(best, dim=-1)
        before = mass.cumsum(dim=-1) - mass
        limit = torch.where(top_p < 1.0, top_p, float("inf")).unsqueeze(1)
        k = torch.minimum(k, (before < limit).sum(dim=-1, keepdim=True).clamp(min=1))
    return _keep_best(logits, k, values.gather(1, k - 1), values.gather(1, k))


class _Nucleus(NamedTuple):
    count: torch.Tensor  # [rows, 1] tokens kept
    cut: torch.Tensor  # [rows, 1] the last kept logit
    after: torch.Tensor  # [rows, 1] the next best logit (= cut when unknown: maybe a tie)
    settled: torch.Tensor  # [rows] whether the window decided the row
    reach: torch.Tensor  # [rows] the fewest tokens an unsettled row needs


def _keep_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Finds each row's nucleus in a window of its best tokens, widened only for rows whose window
    holds less than top_p: tokens outside a window that does are past the cut whatever their order.

    The probabilities and their running sum are float64. In float32 the sum drifts by ~1e-5 over
    thousands of tail tokens, which moves a cut near 0.99 by tens of tokens, and the order the
    softmax summed in (best first for the sort) would decide it.
    """
    rows, vocab = logits.shape
    probs = torch.softmax(logits.double(), dim=-1)
    window = min(_FIRST_WINDOW, vocab)
    nucleus = _nucleus_in_window(logits, probs, top_p, window)
    count, cut, after, settled, reach = nucleus
    todo = (~settled).nonzero().flatten()
    while len(todo):  # rare: rows whose nucleus is wider than the first window
        window = _next_window(logits[todo], probs[todo], top_p[todo], window, reach[~settled])
        nucleus = _nucleus_in_window(logits[todo], probs[todo], top_p[todo], window)
        settled, done = nucleus.settled, todo[nucleus.settled]
        count[done], cut[done] = nucleus.count[settled], nucleus.cut[settled]
        after[done], reach = nucleus.after[settled], nucleus.reach
        todo = todo[~settled]
    return _keep_best(logits, count, cut, after)


def _nucleus_in_window(logits: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor,
                       window: int) -> _Nucleus:
    """Each row's nucleus as far as its `window` best tokens tell. The sort's rule, position by
    position: a token stays while the mass strictly before it is under top_p (the best token
    always stays)."""
    whole = window == logits.shape[-1]
    values, ids = logits.sort(dim=-1, descending=True) if whole else logits.topk(window, dim=-1)
    mass = probs.gather(1, ids)  # tied logits have equal probabilities: their order is moot
    total = mass.cumsum(dim=-1)
    count = ((total - mass) < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)
    cut = values.gather(1, count - 1)
    after = values.gather(1, count.clamp(max=window - 1))
    after = torch.where(count == window, float("-inf") if whole else cut, after)
    # past a window holding top_p, every token has at least top_p before it; past a -inf, none
    # has any probability (min_tokens or logit_bias masked it), so none can change the cut
    settled = (total[:, -1] >= top_p + _MASS_SLACK) | torch.isneginf(values[:, -1]) | whole
    # no token past the window is likelier than its last
    reach = window + (top_p - total[:, -1]) / mass[:, -1]
    return _Nucleus(count, cut, after, settled, reach)


def _next_window(logits: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, window: int,
                 reach: torch.Tensor) -> int:
    """A window that should hold top_p of every row: a histogram of each row's mass by distance
    below its best logit, read up to the bucket where the mass reaches top_p. One pass over the
    vocabulary where doubling the window would take several topk calls; the window is still
    checked exactly. Past half the vocabulary topk costs as much as a sort: take the whole row,
    without the histogram when `reach` already says so (a flat row)."""
    rows, vocab = logits.shape
    if bool((reach > vocab // 2).any()):
        return vocab
    distance = (logits.amax(dim=-1, keepdim=True) - logits) * (_BUCKETS / _BUCKET_SPAN)
    bucket = distance.nan_to_num_(nan=_BUCKETS - 1).clamp_(0, _BUCKETS - 1).long()
    bucket += torch.arange(rows).unsqueeze(1) * _BUCKETS
    mass = torch.bincount(bucket.view(-1), probs.reshape(-1), rows * _BUCKETS)
    tokens = torch.bincount(bucket.view(-1), minlength=rows * _BUCKETS)
    short = mass.view(rows, _BUCKETS).cumsum(dim=-1) < (top_p + 2 * _MASS_SLACK).unsqueeze(1)
    last = short.sum(dim=-1, keepdim=True).clamp(max=_BUCKETS - 1)
    needed = int(tokens.view(rows, _BUCKETS).cumsum(dim=-1).gather(1, last).max())
    window = max(needed, 2 * window)
    return vocab if window > vocab // 2 else window


def _keep_best(logits: torch.Tensor, count: torch.Tensor, cut: torch.Tensor,
               after: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's `count` best logits ([rows, 1]), given the last one kept and the
    next best. Unless they tie (and are real tokens, not -inf), that is a comparison with the cut;
    a tie takes a pass to count the tied: the lowest token ids stay (the sort kept any few)."""
    if not bool(((after == cut) & torch.isfinite(cut)).any()):
        return logits.masked_fill(logits < cut, float("-inf"))
    above = logits > cut
    level = logits == cut
    level &= level.cumsum(dim=-1) <= count - above.sum(dim=-1, keepdim=True)
    return logits.masked_fill(~(above | level), float("-inf"))


def _token_logprobs(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    logprob = float(row_logprobs[token_id])
    rank = int((row_logprobs > row_logprobs[token_id]).sum()) + 1
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = row_logprobs.topk(num_top)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token_id, logprob, rank, top)
