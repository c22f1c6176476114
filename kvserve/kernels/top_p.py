"""Top-p with torch ops: the reference for csrc/sampling.cpp's `top_p_mask_`, and what runs
without the compiled kernels. A window of each row's best tokens (torch.topk) settles most rows
of a trained model; the rest get wider windows, then the whole row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Top-p first looks at this many of a row's best tokens: with a trained model's logits the
# nucleus almost always fits, and torch.topk of a few hundred is ~30x cheaper than a sort of 49k.
_FIRST_WINDOW = 256
# A window settles a row only when its mass clears top_p by this much, so that no token past the
# window can round back under top_p (the sums are float64: their error is ~1e-16 x the vocab).
_MASS_SLACK = 1e-9
# The histogram that sizes the second window: buckets of logit distance below the row's best.
_BUCKETS = 1024
_BUCKET_SPAN = 40.0  # the last bucket takes everything further down, tokens of < e^-40 of the best


def top_p_mask_(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """-inf outside each row's top-p nucleus, in place: csrc/sampling.cpp's op, in torch.
    Float32 logits [R, V], float64 top_p [R] (rows at 1.0 or more are left whole)."""
    rows = (top_p < 1.0).nonzero().flatten()
    if len(rows) == len(top_p):
        logits.copy_(keep_best(logits, *_top_p_cut(logits, top_p)))
    elif len(rows):
        logits[rows] = keep_best(logits[rows], *_top_p_cut(logits[rows], top_p[rows]))


class _Nucleus(NamedTuple):
    count: torch.Tensor  # [rows, 1] tokens kept
    cut: torch.Tensor  # [rows, 1] the last kept logit
    after: torch.Tensor  # [rows, 1] the next best logit (= cut when unknown: maybe a tie)
    settled: torch.Tensor  # [rows] whether the window decided the row
    reach: torch.Tensor  # [rows] the fewest tokens an unsettled row needs


def _top_p_cut(logits: torch.Tensor, top_p: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's top-p nucleus as ([rows, 1] each) the count of tokens kept, the last kept logit
    and the next best one (-inf when none; equal to the cut when a tie may cross it).

    Finds each row's nucleus in a window of its best tokens, widened only for rows whose window
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
    return count, cut, after


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


def keep_best(logits: torch.Tensor, count: torch.Tensor, cut: torch.Tensor,
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
