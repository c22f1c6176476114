"""Drafts from a smaller model with the same tokenizer (vLLM's `draft_model` method).

The draft model runs in the worker that samples (spec_decode/proposers.py), on a paged KV pool
of its own:
each running request keeps its draft KV between steps, so a proposal feeds only the tokens the
draft has not seen (the accepted drafts it already fed are kept, not recomputed), then decodes
its drafts one position at a time for every request at once. Drafts are the draft model's
argmax: a point mass, so the verification (kvserve/sample/sampler.py `verify`: accept a draft
equal to the token the target draws) keeps the target's distribution exactly at any
temperature; the min(1, p/q) rule reduces to it for a point mass q.

What drafting costs is timed per forward (`forwards`, (tokens, seconds) each, which go to the
engine core with the step's drafts), profiled when the worker starts and kept current, so the
core's drafter weighs it against what the drafts save (cost.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvserve.attention import build_attention_metadata
from kvserve.attention.kv_tensors import allocate_kv_caches
from kvserve.model_source import resolve_model
from kvserve.models import load_model
from kvserve.spec_decode.cost import StepCostModel
from kvserve.tokenizer.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

PROFILE_BATCHES = (1, 2, 4, 8, 16, 32)  # sequences per draft forward timed at start-up
PROFILE_CONTEXT = 32  # tokens of each sequence the profile's forwards attend to


@dataclass
class _DraftSequence:
    """One request's draft KV: `blocks` hold its first `num_computed` tokens, then the drafts
    of the last proposal that were fed back (`fed`), which count once the request's tokens
    show them accepted."""

    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    fed: list[int] = field(default_factory=list)
    last_used: int = 0


class DraftModelProposer:
    """`propose_batch` drafts for many requests in one forward per draft position;
    `finish(request_id)` frees a request's draft KV."""

    batched = True

    def __init__(self, model_ref: str, max_drafts: int, *, target_vocab_size: int,
                 target_tokenizer_source, dtype: torch.dtype, device: str,
                 attention_backend: str, use_cpu_kernels: bool, quantization: str,
                 block_size: int, target_num_blocks: int, max_num_seqs: int):
        source = resolve_model(model_ref)
        self.model, self.config = load_model(
            source, dtype, device, attention_backend, use_cpu_kernels=use_cpu_kernels,
            quantization=quantization)
        _check_same_vocabulary(source, self.config.vocab_size, target_tokenizer_source,
                               target_vocab_size)
        self.block_size = block_size
        self.device = torch.device(device)
        self.max_len = self.config.max_position_embeddings
        layouts = self.model.kv_page_layouts(dtype)
        per_block = sum(layout.bytes_per_block(block_size) for layout in layouts)
        # the tokens the target's pool holds, plus every request's drafts past them, plus the
        # tables' padding block (the draft never holds more of a request than the target does)
        self.num_blocks = target_num_blocks + max_num_seqs * -(-max_drafts // block_size) + 1
        self.kv_caches = allocate_kv_caches(layouts, self.num_blocks, block_size, device)
        self.model.bind_kv_cache(self.kv_caches)
        self._free = list(range(self.num_blocks - 1, 0, -1))  # block 0: tables' padding
        self._sequences: dict[str, _DraftSequence] = {}
        self._clock = 0
        self.cost = StepCostModel()
        self.forwards: list[tuple[int, float]] = []  # since the worker last reported them
        logger.info("draft model %s: %d KV blocks (%.1f MiB)", source.name, self.num_blocks,
                    self.num_blocks * per_block / 2**20)

    # ---- proposals ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """Drafts for `(request_id, tokens, num_drafts)` items: up to num_drafts each (none
        for a request the draft model cannot hold: past its positions, or no KV blocks)."""
        self._clock += 1
        active = []  # (request_id, sequence, tokens, num_drafts)
        for request_id, tokens, num_drafts in items:
            sequence = self._prepare(request_id, tokens, num_drafts)
            if sequence is not None:
                active.append((request_id, sequence, tokens, num_drafts))
        drafts: dict[str, list[int]] = {request_id: [] for request_id, _, _ in items}
        if not active:
            return drafts
        # position 0: the tokens each draft KV lacks; then one draft per position
        feeds = [tokens[sequence.num_computed:] for _, sequence, tokens, _ in active]
        lengths = [len(tokens) for _, _, tokens, _ in active]
        for position in range(max(n for *_, n in active)):
            rows = [i for i, item in enumerate(active) if item[3] > position]
            if not rows:
                break
            next_tokens = self._forward([active[i][1] for i in rows], [feeds[i] for i in rows],
                                        [lengths[i] for i in rows])
            for i, token in zip(rows, next_tokens):
                drafts[active[i][0]].append(token)
                feeds[i] = [token]
                lengths[i] += 1
        for request_id, sequence, tokens, _ in active:
            sequence.num_computed = len(tokens)
            sequence.fed = drafts[request_id][:-1]  # the last draft was never fed back
        return drafts

    def _prepare(self, request_id: str, tokens: list[int],
                 num_drafts: int) -> _DraftSequence | None:
        """The request's draft KV state, its accepted drafts counted, with blocks for
        `num_drafts` more positions; None when it cannot be drafted for."""
        if num_drafts <= 0 or len(tokens) + num_drafts - 1 > self.max_len:
            return None
        sequence = self._sequences.setdefault(request_id, _DraftSequence())
        sequence.last_used = self._clock
        if sequence.num_computed > len(tokens):  # cannot happen with growing tokens; be safe
            sequence.num_computed, sequence.fed = 0, []
        accepted = 0
        for fed, token in zip(sequence.fed, tokens[sequence.num_computed:]):
            if fed != token:
                break
            accepted += 1
        sequence.num_computed = min(sequence.num_computed + accepted, len(tokens) - 1)
        sequence.fed = []
        needed = -(-(len(tokens) + num_drafts - 1) // self.block_size) - len(sequence.blocks)
        if needed > 0 and not self._allocate(sequence, needed):
            return None
        return sequence

    def _allocate(self, sequence: _DraftSequence, count: int) -> bool:
        """`count` more blocks for the sequence, taking them from the least recently drafted
        other requests when the pool is out (they recompute their draft KV if they come back)."""
        if len(self._free) < count:
            idle = sorted((s for s in self._sequences.values()
                           if s.last_used < self._clock and s.blocks),
                          key=lambda s: s.last_used)
            for other in idle:
                self._release(other)
                if len(self._free) >= count:
                    break
        if len(self._free) < count:
            return False
        sequence.blocks.extend(self._free.pop() for _ in range(count))
        return True

    def _release(self, sequence: _DraftSequence) -> None:
        self._free.extend(reversed(sequence.blocks))
        sequence.blocks, sequence.num_computed, sequence.fed = [], 0, []

    def _forward(self, sequences: list[_DraftSequence], feeds: list[list[int]],
                 seq_lens: list[int]) -> list[int]:
        """One draft forward: each sequence's `feeds` tokens end at `seq_lens`; the argmax
        after each sequence's last token."""
        start = time.perf_counter()
        query_lens = [len(feed) for feed in feeds]
        metadata, positions = build_attention_metadata(
            query_lens, seq_lens, [s.blocks for s in sequences], self.block_size, self.device)
        input_ids = torch.tensor([t for feed in feeds for t in feed], dtype=torch.long,
                                 device=self.device)
        hidden = self.model(input_ids, positions, metadata)
        last = torch.tensor(metadata.query_start_loc_host[1:], device=self.device) - 1
        tokens = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        seconds = time.perf_counter() - start
        self.cost.observe(sum(query_lens), seconds)
        self.forwards.append((sum(query_lens), seconds))
        return tokens

    def finish(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self._release(sequence)

    # ---- start-up -------------------------------------------------------------------------
    def profile(self) -> None:
        """Time draft forwards of 1 to 32 sequences decoding (after a short context), three
        times each, so the first proposals already know what drafting costs here."""
        start = time.perf_counter()
        for batch in PROFILE_BATCHES * 3:
            ids = [f"profile-{n}" for n in range(batch)]
            contexts = [[3 + n] * PROFILE_CONTEXT for n in range(batch)]
            self.propose_batch([(i, c, 1) for i, c in zip(ids, contexts)])  # prefill
            self.propose_batch([(i, c + [5], 1) for i, c in zip(ids, contexts)])  # decode
            for request_id in ids:
                self.finish(request_id)
        logger.info("draft model: forward costs profiled in %.1fs: %s",
                    time.perf_counter() - start,
                    {size: f"{seconds * 1e3:.1f} ms" for size, seconds in
                     self.cost.points().items() if size <= max(PROFILE_BATCHES)})


def _check_same_vocabulary(draft_source, draft_vocab_size: int, target_source,
                           target_vocab_size: int) -> None:
    """Drafts are token ids of the target: the two models must share a vocabulary (the same
    size, and the same token for every id)."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary has "
                         f"{draft_vocab_size} tokens, the target's {target_vocab_size}: drafts "
                         "need the target's tokenizer")
    draft, target = load_tokenizer(draft_source), load_tokenizer(target_source)
    if draft.backend.get_vocab(with_added_tokens=True) != \
            target.backend.get_vocab(with_added_tokens=True):
        raise ValueError("speculative_config: the draft model's tokenizer differs from the "
                         "target's: drafts need the same token ids")
