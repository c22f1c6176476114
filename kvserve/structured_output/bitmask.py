"""A token bitmask (xgrammar's layout: int32 words, bit j of word w allows token 32 w + j)
applied to logits rows: every token it does not allow becomes -inf."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool."""
    return ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().flatten(1)[:, :vocab_size]


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                         mask_rows: list[int]) -> None:
    """Logits row rows[i] masked by bitmask row mask_rows[i], in place. A row whose mask
    allows nothing is left alone (sampling from all -inf would be NaN)."""
    allowed = allowed_tokens(bitmask[mask_rows], logits.shape[1])
    empty = ~allowed.any(dim=1)
    if bool(empty.any()):
        allowed[empty] = True
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
