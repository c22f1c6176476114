"""MTP drafts (vLLM's `mtp` method): the checkpoint's own next-token-prediction modules
(models/layers/mtp.py) as the proposer, in the worker beside the target, reading its hidden
states.

Every step, after sampling, the first module runs over every token the target computed (prompt
chunks too): at position i it takes the target's hidden state there and the token at i + 1 (the
next prompt token, or the token the step sampled or verified there). That writes the module's
KV at every position the target computed, in the target's blocks, so its attention always has
the whole context. Rows past what a verification kept were fed rejected drafts; their KV
positions are written again by the next step, before anything reads them.

A request that sampled then drafts from the row of its last known token: the argmax of the
module's head is the first draft (the token after the one just sampled). Each further draft
runs a module one position on, on its own previous output and the draft before (module j of n
for draft j, reused round-robin past n, as vLLM does), while its position stays within the
request's allocated blocks. Drafting (the head, and each further position) is timed per draft
position and priced by the engine core as a draft model's forwards are, so where drafts do not
pay the module only keeps its KV. Drafts are argmax, a point mass, so verification keeps the target's
distribution exactly (sample/sampler.py `verify`); greedy output is the target's own.
"""

from __future__ import annotations

import time

import torch

from kvserve.attention import build_attention_metadata
from kvserve.attention.kv_tensors import allocate_kv_caches
from kvserve.errors import UnsupportedArchitectureError
from kvserve.spec_decode.proposal import ProposalStep


def load_mtp_modules(target, source, count: int):
    """The target's checkpoint's first `count` MTP modules, built by its family, in its dtype,
    loaded; an error naming what is missing when the config or the file has none."""
    from kvserve.models.layers.mtp import MultiTokenPredictor
    from kvserve.models.loader import allocate_parameters, iter_hf_checkpoint

    config = target.full_config
    if config.num_nextn_predict_layers <= 0:
        raise UnsupportedArchitectureError(
            f"speculative_config: method 'mtp' drafts with a checkpoint's multi-token-"
            f"prediction modules, and this {config.architecture} model's config has none "
            "(num_nextn_predict_layers is 0)")
    if source.format != "hf":
        raise UnsupportedArchitectureError(
            "speculative_config: method 'mtp' loads the MTP modules from an HF directory; a "
            "GGUF keeps none (llama.cpp's converter drops DeepSeek's nextn layers)")
    device = next(target.parameters()).device
    with torch.device("meta"):
        mtp = MultiTokenPredictor(target, count)
    allocate_parameters(mtp, target.activation_dtype, device)
    mtp.load(iter_hf_checkpoint(source, config))
    return mtp.eval().requires_grad_(False)


class MTPProposer:
    """Drafts from the MTP modules (the module docstring), with their own KV tensors in the
    target pool's block layout."""

    keeps_forward = True  # reads the target's step (ForwardView)

    def __init__(self, mtp, target, kv_dtype: torch.dtype, num_blocks: int, block_size: int,
                 device: str):
        self.layers = mtp.layers
        self.ops = target.model.layer_ops
        self.block_size = block_size
        self.device = torch.device(device)
        layouts = [layer.block.self_attn.kv_page_layout(kv_dtype) for layer in self.layers]
        self.kv_caches = allocate_kv_caches(layouts, num_blocks, block_size, device)
        for layer, cache in zip(self.layers, self.kv_caches):
            layer.block.self_attn.kv_cache = cache
            layer.block.self_attn.kv_group = 0
        self.forwards: list[tuple[int, float]] = []  # drafting since the worker last asked

    @torch.inference_mode()
    def propose(self, step: ProposalStep) -> dict[str, list[int]]:
        forward = step.forward
        if forward is None or not forward.scheduled:
            return {}
        next_ids, last_rows = self._shifted(forward, step)
        first = self.layers[0]
        hidden = first(self.ops, next_ids, forward.positions, forward.hidden, forward.metadata)
        drafting = [(request_id, row, limit) for request_id, row in last_rows.items()
                    if (limit := step.limits.get(request_id, 0)) > 0]
        if not drafting:
            return {}
        start = time.perf_counter()
        previous = hidden[torch.tensor([row for _, row, _ in drafting], device=self.device)]
        tokens = first.logits(self.ops, previous).argmax(dim=-1).tolist()
        drafts = {request_id: [token] for (request_id, _, _), token in zip(drafting, tokens)}
        self.forwards.append((len(drafting), time.perf_counter() - start))
        last_known = {request_id: len(step.requests[request_id].all_token_ids) - 2
                      for request_id, _, _ in drafting}
        rows = list(range(len(drafting)))  # into `previous`
        for j in range(1, max(limit for *_, limit in drafting)):
            rows = [i for i in rows if drafting[i][2] > j and self._fits(
                step.requests[drafting[i][0]], last_known[drafting[i][0]] + j)]
            if not rows:
                break
            start = time.perf_counter()
            ids = [drafting[i][0] for i in rows]
            layer = self.layers[j % len(self.layers)]
            metadata, positions = build_attention_metadata(
                [1] * len(rows), [last_known[r] + j + 1 for r in ids],
                [step.requests[r].block_ids for r in ids], self.block_size, self.device)
            inputs = torch.tensor([drafts[r][-1] for r in ids], dtype=torch.long,
                                  device=self.device)
            out = layer(self.ops, inputs, positions, previous[rows], metadata)
            previous = previous.clone()
            previous[rows] = out
            for request_id, token in zip(ids, layer.logits(self.ops, out).argmax(dim=-1).tolist()):
                drafts[request_id].append(token)
            self.forwards.append((len(rows), time.perf_counter() - start))
        return drafts

    def _shifted(self, forward, step: ProposalStep) -> tuple[torch.Tensor, dict[str, int]]:
        """Each row's next token (where the request's tokens know it; a rejected draft's row
        keeps its own token, its output unused), and the row of each sampling request's last
        known token."""
        next_ids: list[int] = []
        last_rows: dict[str, int] = {}
        for item in forward.scheduled:
            request = item.request
            tokens, start, count = request.all_token_ids, item.start_position, len(item.token_ids)
            known = tokens[start + 1:start + count + 1]
            row = len(next_ids)
            next_ids.extend(known)
            next_ids.extend(item.token_ids[len(known):])
            last = len(tokens) - 2 - start
            if request.request_id in step.sampled and 0 <= last < count:
                last_rows[request.request_id] = row + last
        return torch.tensor(next_ids, dtype=torch.long, device=self.device), last_rows

    def _fits(self, request, position: int) -> bool:
        """Whether the request's blocks hold `position` (a draft's KV is written there)."""
        return position // self.block_size < len(request.block_ids)

    def finish(self, request_id: str) -> None:
        pass  # no state per request: its KV lives in the target's blocks

    def take_forwards(self) -> list[tuple[int, float]]:
        """The drafting this proposer did since asked: per draft position, (requests, seconds)
        of its head (and module, past the first); the fill pass is part of every step."""
        forwards, self.forwards = self.forwards, []
        return forwards
