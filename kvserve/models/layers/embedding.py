"""The token embedding and the LM head, each split by vocabulary rows over tensor-parallel ranks.

Each rank holds ceil(vocab / tp) rows (the last padded with zeros) and embeds only the ids in its
range; the others come out as zero rows, so one all-reduce assembles every token's embedding
exactly (one non-zero term per element). The LM head computes its rank's vocabulary range of
the logits (the sampled rows are gathered), from its own weights or, tied, the embedding's; its
layer (int8 in quantized modes, bf16 panels in bfloat16) is the quant policy's choice, built from
the float32 weights as they are loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import ParallelContext, active
from kvserve.distributed.sharding import ShardRule, take_shard, vocab_range
from kvserve.quant import QuantPolicy
from kvserve.quant.methods import as_float


def _vocab_rule(vocab_size: int, parallel: ParallelContext | None) -> ShardRule | None:
    if parallel is None:
        return None
    start, end, padded = vocab_range(vocab_size, parallel.tp_size, parallel.tp_rank)
    return ShardRule(0, ((start, end),), padded)


class TokenEmbedding(nn.Module):
    """The table as float rows (`weight`), or, where the quant policy keeps the file's block
    type (`gguf`), as packed blocks whose looked-up rows are dequantized each step (`stored`:
    the tied LM head then multiplies the same blocks)."""

    def __init__(self, vocab_size: int, hidden_size: int,
                 parallel: ParallelContext | None = None, quant: QuantPolicy | None = None):
        super().__init__()
        self.parallel = active(parallel)
        self.rule = _vocab_rule(vocab_size, self.parallel)
        rows = vocab_size if self.rule is None else self.rule.pad_to
        self.vocab_start, self.vocab_end = (0, vocab_size) if self.rule is None \
            else self.rule.ranges[0]
        self.quant = quant
        self.keeps_blocks = quant is not None and \
            quant.stored_type("model.embed_tokens.weight") is not None
        self.stored: nn.Module | None = None
        self.weight = None if self.keeps_blocks else \
            nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def load(self, tensor) -> None:
        """The whole model's table -> this rank's rows."""
        rows = take_shard(tensor, self.rule)
        if self.keeps_blocks:
            self.stored = self.quant.head_impl(rows)
        else:
            self.weight.data.copy_(as_float(rows))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.stored is not None:
            return self.stored.rows(ids, self.quant.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            return self.lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        embedded = self.lookup(local_ids)
        embedded.masked_fill_(outside.unsqueeze(-1), 0)
        self.parallel.communicator.all_reduce_(embedded)
        return embedded


class LogitsHead(nn.Module):
    """This rank's vocabulary range of the logits, through the layer the quant policy chose."""

    def __init__(self, vocab_size: int, hidden_size: int, quant: QuantPolicy,
                 parallel: ParallelContext | None = None,
                 tied_to: TokenEmbedding | None = None):
        super().__init__()
        self.rule = _vocab_rule(vocab_size, active(parallel))
        self.quant = quant
        self.hidden_size = hidden_size
        self._tied = (tied_to,) if tied_to is not None else None  # the embedding owns it
        self.weight: nn.Parameter | None = None  # an untied head's float weights, if kept
        self.impl: nn.Module | None = None
        self.loaded = False

    @property
    def tied(self) -> bool:
        return self._tied is not None

    def load(self, tensor) -> None:
        """The whole model's head (or, tied, embedding) weights, as read: float32 for a
        quantized head, so its codes come from the exact values (a GGUF's Q8_0 blocks)."""
        if self.tied and self._tied[0].stored is not None:  # the embedding's blocks, shared
            self.impl = self._tied[0].stored
        else:
            rows = take_shard(tensor, self.rule)
            self.impl = self.quant.head_impl(rows)
            if self.impl is None and not self.tied:
                self.weight = nn.Parameter(as_float(rows).to(self.quant.dtype),
                                           requires_grad=False)
        self.loaded = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.impl is not None:
            return self.impl.forward(hidden)
        weight = self._tied[0].weight if self.tied else self.weight
        return F.linear(hidden, weight)
