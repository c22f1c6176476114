"""AttentionMetadata: how one flattened ragged batch maps onto the paged KV cache.

Sequence i contributes tokens query_start_loc[i]:query_start_loc[i+1] of the batch; after this step
it holds seq_lens[i] tokens of KV, the new ones last. Token t's K/V goes to cache slot
slot_mapping[t] = block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU backends can loop over sequences without device syncs.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # Per-step choices a backend computes on the first layer and reuses (see attention/paged.py)
    plan: object | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata plus the absolute position of every token in the batch.

    Each sequence's new tokens are the last query_lens[i] of its seq_lens[i] tokens.
    """
    num_seqs = len(query_lens)
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_index = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t)
    first_new_position = seq_lens_t - query_lens_t
    positions = torch.arange(num_tokens) - query_start_loc[seq_index] + first_new_position[seq_index]
    width = max(max((len(table) for table in block_tables), default=0), 1)
    # one tensor from padded lists: a small tensor + copy per sequence cost ~10 us each
    padded = [table + [0] * (width - len(table)) for table in block_tables]
    table_t = torch.tensor(padded, dtype=torch.int64).view(num_seqs, width)
    block_ids = table_t[seq_index, positions // block_size]
    slot_mapping = block_ids * block_size + positions % block_size
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens_t.to(device=device, dtype=torch.int32),
        slot_mapping=slot_mapping.to(device),
        block_tables=table_t.to(device=device, dtype=torch.int32),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_host=query_start_loc.tolist(),
        seq_lens_host=list(seq_lens),
    )
    return metadata, positions.to(device)
