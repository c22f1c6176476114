"""The token embedding split by vocabulary rows over tensor-parallel ranks.

Each rank holds ceil(vocab / tp) rows (the last padded with zeros) and embeds only the ids in its
range; the others come out as zero rows, so one all-reduce assembles every token's embedding
exactly (one non-zero term per element). The tied LM head reuses these rows: each rank computes
the logits of its vocabulary range and the sampled rows are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import ParallelContext
from kvserve.distributed.sharding import vocab_range


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext):
        super().__init__()
        self.vocab_start, self.vocab_end, shard_rows = vocab_range(
            vocab_size, parallel.tp_size, parallel.tp_rank)
        self.weight = nn.Parameter(torch.empty(shard_rows, hidden_size))
        self.communicator = parallel.communicator

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        embedded = F.embedding(local_ids, self.weight)
        embedded.masked_fill_(outside.unsqueeze(-1), 0)
        self.communicator.all_reduce_(embedded)
        return embedded
