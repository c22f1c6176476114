"""Token sampling for a batch of rows, each with its own SamplingParams.

Order, as in vLLM: logit_bias, min_tokens masking, penalties, then greedy argmax or temperature ->
top-k -> top-p -> min-p -> a draw. Seeded rows draw from their own torch.Generator, so the same
seed gives the same tokens whatever else is in the batch. Logprobs are of the raw model logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and rank, plus the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0, argmax_rows=None):
        self.default_generator = torch.Generator().manual_seed(seed)
        # the compiled kernel when the runner has one (torch's CPU argmax is slow on [B, 49k])
        self.argmax_rows = argmax_rows or (lambda logits: logits.argmax(dim=-1))

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float().cpu()
        raw_logprobs = None
        if any(row.params.logprobs is not None for row in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(_modifies_logits(row) for row in rows):
            logits = logits.clone()  # the processors below write in place
        _apply_logit_bias(logits, rows)
        _apply_min_tokens(logits, rows)
        _apply_penalties(logits, rows)
        token_ids = self._choose(logits, rows)
        logprobs = [
            _token_logprobs(raw_logprobs[i], token_ids[i], row.params.logprobs)
            if raw_logprobs is not None and row.params.logprobs is not None else None
            for i, row in enumerate(rows)
        ]
        return SamplerOutput(token_ids, logprobs)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        chosen = self.argmax_rows(logits.contiguous())
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            probs = _filtered_probs(logits[random_rows], [rows[i].params for i in random_rows])
            noise = self._exponential_noise(probs.shape, [rows[i] for i in random_rows])
            chosen[random_rows] = (probs / noise).argmax(dim=-1)
        return chosen.tolist()

    def _exponential_noise(self, shape, rows: list[SamplingRow]) -> torch.Tensor:
        """argmax(p / E) with E ~ Exp(1) is a draw from p (the Gumbel-max trick in disguise)."""
        noise = torch.empty(shape)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=row.generator or self.default_generator)
        return noise


def _modifies_logits(row: SamplingRow) -> bool:
    params = row.params
    return bool(params.logit_bias) or params.needs_penalties or (
        len(row.output_token_ids) < params.min_tokens and bool(params.all_stop_token_ids))


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(row.params.logit_bias.values()))


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) < params.min_tokens and params.all_stop_token_ids:
            logits[i, list(params.all_stop_token_ids)] = float("-inf")


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        params = row.params
        if not params.needs_penalties:
            continue
        counts = torch.zeros(vocab)
        if row.output_token_ids:
            counts.scatter_add_(0, torch.tensor(row.output_token_ids),
                                torch.ones(len(row.output_token_ids)))
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            if row.prompt_token_ids:
                seen[torch.tensor(row.prompt_token_ids)] = True
            penalty = params.repetition_penalty
            row_logits = logits[i]
            scaled = torch.where(row_logits > 0, row_logits / penalty, row_logits * penalty)
            logits[i] = torch.where(seen, scaled, row_logits)
        logits[i] -= params.frequency_penalty * counts
        logits[i] -= params.presence_penalty * (counts > 0).float()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
    if bool((min_p > 0).any()):
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k]).unsqueeze(1)
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    remove = before >= torch.tensor(top_p).unsqueeze(1)
    remove[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _token_logprobs(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    logprob = float(row_logprobs[token_id])
    rank = int((row_logprobs > row_logprobs[token_id]).sum()) + 1
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = row_logprobs.topk(num_top)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token_id, logprob, rank, top)
