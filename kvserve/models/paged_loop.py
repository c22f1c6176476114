"""A minimal paged forward/greedy loop over ragged batches: model-level tests and the perplexity
benchmark run a model without the engine.

It gives each sequence consecutive blocks of a private pool; the engine's scheduler and KV manager
(kvserve.core) do the real bookkeeping. Used to test the model and attention in isolation.
"""

from __future__ import annotations

import torch

from kvserve.attention import build_attention_metadata
from kvserve.attention.kv_tensors import allocate_kv_caches


class PagedLoop:
    def __init__(self, model, num_seqs: int, max_len: int, block_size: int = 16,
                 kv_dtype=None):
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = (max_len + block_size - 1) // block_size
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.device = device
        caches = allocate_kv_caches(model.kv_page_layouts(kv_dtype or dtype),
                                    num_seqs * self.blocks_per_seq, block_size, device)
        model.bind_kv_cache(caches)
        # Interleave block ids across sequences so block tables are not trivially contiguous.
        self.block_tables = [list(range(i, num_seqs * self.blocks_per_seq, num_seqs))
                             for i in range(num_seqs)]

    @torch.no_grad()
    def step(self, chunks: list[list[int]], seq_lens: list[int], seq_ids: list[int],
             all_logits: bool = False) -> list[torch.Tensor]:
        """Run new tokens `chunks[i]` of sequences `seq_ids[i]` (which then hold seq_lens[i]
        tokens). Returns logits per sequence: all positions, or just the last one."""
        metadata, positions = build_attention_metadata(
            [len(c) for c in chunks], seq_lens, [self.block_tables[i] for i in seq_ids],
            self.block_size, self.device)
        input_ids = torch.tensor([t for c in chunks for t in c], device=self.device)
        hidden = self.model(input_ids, positions, metadata)
        ends = metadata.query_start_loc_host
        if all_logits:
            logits = self.model.compute_logits(hidden)
            return [logits[ends[i]:ends[i + 1]] for i in range(len(chunks))]
        last = torch.tensor(ends[1:], device=self.device) - 1
        return list(self.model.compute_logits(hidden[last]))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of every prompt, all in one ragged batch per step."""
        seq_ids = list(range(len(prompts)))
        lengths = [len(p) for p in prompts]
        logits = self.step(prompts, lengths, seq_ids)
        outputs = [[int(l.argmax())] for l in logits]
        for _ in range(max_new_tokens - 1):
            lengths = [n + 1 for n in lengths]
            logits = self.step([[o[-1]] for o in outputs], lengths, seq_ids)
            for out, l in zip(outputs, logits):
                out.append(int(l.argmax()))
        return outputs
