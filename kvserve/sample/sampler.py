"""Token sampling for a batch of rows, each with its own SamplingParams.

Order, as in vLLM: the logits processors that can change a greedy choice (logit_bias, min_tokens,
penalties, then custom ones), then greedy argmax, or temperature -> top-k -> top-p -> the
argmax-invariant processors (min_p, then custom ones) -> a draw. Seeded rows draw from their own
torch.Generator, so the same seed gives the same tokens whatever else is in the batch. Logprobs
are of the raw model logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Callable, Sequence

import torch

from kvserve.kernels import reference
from kvserve.kernels.top_p import keep_best
from kvserve.protocol.worker import TokenLogprobs
from kvserve.sample.builtin_processors import builtin_processors
from kvserve.sample.logits_processor import SAMPLING_DEVICE, AddedRow, BatchUpdate, LogitsProcessor
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


@dataclass
class SpecSamplerOutput:
    """Per row: the tokens it emits (accepted drafts, then a replacement or bonus token) and
    their logprobs (None where not asked)."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]


class Sampler:
    def __init__(self, seed: int = 0, ops: SimpleNamespace | ModuleType | None = None,
                 logits_processors: Sequence[LogitsProcessor] = ()):
        """`ops`: the runner's kernel op set, whose `argmax_rows`, `top_p_mask_` and `draw_rows`
        make the per-row passes over the vocabulary (torch's reference ops when None: its CPU
        argmax, topk windows and sort are several times slower on [B, 49k] rows).
        `logits_processors`: custom ones, run after the built-ins of their kind."""
        self.default_generator = torch.Generator().manual_seed(seed)
        self.ops = ops if ops is not None else reference
        self.processors = [*builtin_processors(), *logits_processors]
        self._num_rows = 0  # the batch's size, as the processors know it

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 batch_update: BatchUpdate | None = None) -> SamplerOutput:
        """`rows` in the persistent batch's order, and its changes since the last call
        (`batch_update`, empty when none); without one the rows are a batch of their own."""
        self._update_processors(rows, batch_update)
        logits = logits.float().to(SAMPLING_DEVICE)
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

    @torch.no_grad()
    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
               batch_update: BatchUpdate | None = None) -> SpecSamplerOutput:
        """Speculative decoding's verification, exact: row i's logits are the
        `len(drafts[i]) + 1` rows of `logits` from its offset on (its last real token's, then
        each draft's). Depth by depth, every option applies as it would without drafts, the
        accepted drafts counted as output (penalties, min_tokens; they are appended to the
        rows' output lists meanwhile, and removed again before returning). Every row picks its
        token as it would without drafts (the argmax, or a draw from the filtered target q)
        and accepts the draft when it equals that token. For a random row that is rejection
        sampling with coupled randomness: the draft is kept with probability q(d), the best a
        point-mass draft can get, and the emitted token is distributed exactly as q; and each
        emitted token takes one draw, as without drafts, so a seeded request gives the same
        tokens whatever number of drafts the step-cost model chose. A row stops at its first
        rejection (the drawn token is its last) or emits a bonus token after its last draft.
        Logprobs are the target's, of each emitted token."""
        self._update_processors(rows, batch_update)
        logits = logits.float().to(SAMPLING_DEVICE)
        offsets = [0]
        for row_drafts in drafts:
            offsets.append(offsets[-1] + len(row_drafts) + 1)
        if self._argmax_verifies(rows):
            return _verify_by_argmax(self.ops.argmax_rows(logits.contiguous()).tolist(),
                                     offsets, drafts)
        emitted: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[TokenLogprobs] | None] = [
            [] if row.params.logprobs is not None else None for row in rows]
        lengths = [len(row.output_token_ids) for row in rows]
        active, depth = list(range(len(rows))), 0
        # the batch's logits at the current depth, one row per request (the processors index
        # the whole batch): every row at depth 0, then only the rows still verifying are
        # refreshed (the others are stale and ignored), so deeper depths cost what their
        # few rows do
        step = logits[offsets[:-1]]
        try:
            while active:
                if depth:
                    self._update_processors(rows, BatchUpdate(len(rows)))  # outputs grew
                    step[active] = logits[[offsets[i] + depth for i in active]]
                step_drafts = {i: drafts[i][depth] for i in active if depth < len(drafts[i])}
                tokens, accepted = self._verify_depth(step, rows, active, step_drafts,
                                                      logprobs)
                for i, token in zip(active, tokens):
                    emitted[i].append(token)
                    rows[i].output_token_ids.append(token)
                active = [i for i in active if i in accepted]
                depth += 1
        finally:
            for row, length in zip(rows, lengths):
                del row.output_token_ids[length:]
        return SpecSamplerOutput(emitted, logprobs)

    def _argmax_verifies(self, rows: list[SamplingRow]) -> bool:
        """Whether every row's token at every depth is its logits' argmax: greedy rows without
        logprobs, and no processor that can move an argmax active (a processor's activity is
        its rows', fixed through the depths). Then one argmax over all rows verifies the step:
        the depth loop (processor updates, index copies, one call a depth) took 479 us for a
        4-draft verification over SmolLM2's vocabulary, this 158."""
        return (all(row.params.greedy and row.params.logprobs is None for row in rows)
                and not self._active(argmax_invariant=False))

    def _verify_depth(self, logits: torch.Tensor, rows: list[SamplingRow], active: list[int],
                      drafts: dict[int, int], logprobs: list) -> tuple[list[int], set[int]]:
        """One depth of `verify`: the token each active row emits here, and the rows whose
        draft was accepted (they go on to the next depth). `logits` is the verifier's own
        buffer: the processors edit it in place."""
        wanting = [i for i in active if logprobs[i] is not None]
        raw = dict(zip(wanting, torch.log_softmax(logits[wanting], dim=-1))) if wanting else {}
        processors = self._active(argmax_invariant=False)
        if processors:
            logits = _run(processors, logits)
        chosen: dict[int, int] = {}
        greedy = [i for i in active if rows[i].params.greedy]
        if greedy:
            best = self.ops.argmax_rows(logits[greedy].contiguous()).tolist()
            chosen.update(zip(greedy, best))
        accepted = {i for i in greedy if drafts.get(i) == chosen[i]}
        random_rows = [i for i in active if not rows[i].params.greedy]
        if random_rows:  # drawn as without drafts; a draft equal to the draw is accepted
            filtered = self._random_logits(logits, random_rows,
                                           [rows[i].params for i in random_rows])
            drawn = self._draw(filtered, [rows[i] for i in random_rows]).tolist()
            chosen.update(zip(random_rows, drawn))
            accepted |= {i for i in random_rows if drafts.get(i) == chosen[i]}
        tokens = [chosen[i] for i in active]
        for i, token in zip(active, tokens):
            if i in raw:
                logprobs[i].append(_token_logprobs(raw[i], token, rows[i].params.logprobs))
        return tokens, accepted

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
        chosen = self.ops.argmax_rows(logits.contiguous())
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            filtered = self._random_logits(logits, random_rows,
                                           [rows[i].params for i in random_rows])
            chosen[random_rows] = self._draw(filtered, [rows[i] for i in random_rows])
        return chosen.tolist()

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row from the softmax of its filtered logits. Seeded rows race
        exponential noise over the whole vocabulary from their own generator, so a seed gives
        the tokens it always gave; the others take one uniform each from the sampler's generator
        and the inverse CDF (`draw_rows`: no softmax tensor, no noise, which cost ~1.5 ms a row
        at 49k tokens)."""
        seeded = [i for i, row in enumerate(rows) if row.generator is not None]
        if not seeded:
            uniforms = torch.rand(len(rows), dtype=torch.float64, generator=self.default_generator)
            return self.ops.draw_rows(logits, uniforms)
        chosen = torch.empty(len(rows), dtype=torch.long)
        probs = torch.softmax(logits[seeded], dim=-1)
        noise = self._exponential_noise(probs.shape, [rows[i] for i in seeded])
        chosen[seeded] = (probs / noise).argmax(dim=-1)
        others = [i for i, row in enumerate(rows) if row.generator is None]
        if others:
            uniforms = torch.rand(len(others), dtype=torch.float64,
                                  generator=self.default_generator)
            chosen[others] = self.ops.draw_rows(logits[others], uniforms)
        return chosen

    def _random_logits(self, logits: torch.Tensor, random_rows: list[int],
                       params: list[SamplingParams]) -> torch.Tensor:
        """The random rows' logits to draw from: temperature, top-k/top-p, then the
        argmax-invariant processors. Those index the whole batch, so a batch that also has greedy
        rows is handed over whole (its greedy rows are chosen already, and untouched by design)."""
        everything = len(random_rows) == logits.shape[0]
        filtered = _filtered_logits(logits if everything else logits[random_rows], params,
                                    self.ops.top_p_mask_)
        processors = self._active(argmax_invariant=True)
        if processors and everything:
            filtered = _run(processors, filtered)
        elif processors:
            index = torch.tensor(random_rows)
            filtered = _run(processors, logits.index_put((index,), filtered))[index]
        return filtered.contiguous()

    def _exponential_noise(self, shape, rows: list[SamplingRow]) -> torch.Tensor:
        """argmax(p / E) with E ~ Exp(1) is a draw from p (the Gumbel-max trick in disguise)."""
        noise = torch.empty(shape)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=row.generator)
        return noise


# (logits [R, V] float32, top_p [R] float64 < 1): -inf outside each row's nucleus, in place
TopPMask = Callable[[torch.Tensor, torch.Tensor], None]


def _run(processors: list[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
    for processor in processors:
        logits = processor.apply(logits)
    return logits


def _filtered_logits(logits: torch.Tensor, params: list[SamplingParams],
                     top_p_mask_: TopPMask) -> torch.Tensor:
    """Temperature, then -inf outside each row's top-k and top-p (a new tensor)."""
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p, top_p_mask_)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                 top_p_mask_: TopPMask) -> torch.Tensor:
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
                    lambda rows: _keep_top_p(logits[rows], p[rows], top_p_mask_))


def _on_rows(logits: torch.Tensor, which: torch.Tensor,
             keep: Callable[[torch.Tensor | slice], torch.Tensor]) -> torch.Tensor:
    """`keep(rows)` for the rows `which` selects, written back; no copies when that is all rows."""
    if bool(which.all()):
        return keep(slice(None))
    rows = which.nonzero().flatten()
    return logits.index_put((rows,), keep(rows)) if len(rows) else logits


def _keep_top_p(logits: torch.Tensor, top_p: torch.Tensor, top_p_mask_: TopPMask) -> torch.Tensor:
    """`logits` (rows of the step's own filtered tensor, or a copy of some) masked in place."""
    top_p_mask_(logits, top_p)
    return logits


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
    return keep_best(logits, k, values.gather(1, k - 1), values.gather(1, k))


def _token_logprobs(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    logprob = float(row_logprobs[token_id])
    rank = int((row_logprobs > row_logprobs[token_id]).sum()) + 1
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = row_logprobs.topk(num_top)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token_id, logprob, rank, top)


def _verify_by_argmax(best: list[int], offsets: list[int],
                      drafts: list[list[int]]) -> SpecSamplerOutput:
    """Greedy verification from each logits row's argmax (`best`, rows in the step's order):
    a request emits the argmax at each depth while its draft there equals it, then the argmax
    after its first mismatch or its bonus token after its last draft."""
    emitted = []
    for start, row_drafts in zip(offsets, drafts):
        tokens = []
        for depth, draft in enumerate(row_drafts):
            tokens.append(best[start + depth])
            if tokens[-1] != draft:
                break
        else:
            tokens.append(best[start + len(row_drafts)])
        emitted.append(tokens)
    return SpecSamplerOutput(emitted, [None] * len(drafts))
