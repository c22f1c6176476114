"""Prompt logprobs: how likely the model found each prompt token, from the raw logits of the
position before it (what evaluation harnesses score: lm-eval's loglikelihood tasks).

A step's prompt positions are scored in slices of rows, so a long chunk on a large vocabulary
never holds its whole [tokens, vocab] logits at once (512 x 262k float32 would be 512 MiB).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvserve.protocol.worker import TokenLogprobs

# rows scored at once: bounds the float32 logits held to ROWS x vocab
ROWS_PER_SLICE = 64


def score_prompt_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                      hidden: torch.Tensor, targets: list[int], num_top: int,
                      keep: bool = True) -> list[TokenLogprobs]:
    """Each row's logprob of its target token (the next prompt token), its rank among the
    vocabulary (1 = the model's first choice) and the `num_top` best alternatives.
    `compute_logits` runs on every tensor-parallel rank (it gathers the vocabulary); `keep`
    False on ranks whose results nobody reads."""
    entries: list[TokenLogprobs] = []
    for start in range(0, len(targets), ROWS_PER_SLICE):
        logits = compute_logits(hidden[start:start + ROWS_PER_SLICE])
        if keep:
            entries += _entries(torch.log_softmax(logits.float(), dim=-1),
                                targets[start:start + ROWS_PER_SLICE], num_top)
    return entries


def _entries(logprobs: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprobs]:
    target = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, target)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=1)
        tops = [list(zip(ids, vals)) for ids, vals in zip(top_ids.tolist(), top_values.tolist())]
    return [TokenLogprobs(token, value, rank, top)
            for token, value, rank, top in zip(targets, values, ranks, tops)]
