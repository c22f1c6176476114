"""Speculative decoding's proposers, where vLLM runs them: in the worker, beside the model, on
the rank that samples. After each step the proposer drafts for every request that sampled, as
many tokens as the engine core allowed it (`ExecuteStep.draft_limits`: the drafter's judgement
of what pays, core/engine_core.py); the drafts go back with the step's samples and the core
keeps what still pays once it has seen the step (spec_decode/drafter.py).

A proposer: `propose(step) -> {request id: drafts}`, `finish(request_id)`, and
`take_forwards()`: the draft forwards it ran since asked, (tokens, seconds) each, which the
core prices drafting by (a draft model's; context proposers and MTP report none: their cost is
in the target's step time).

- `ContextProposals`: ngram (prompt lookup) and suffix decoding, over the request's tokens;
- `DraftModelProposals`: a smaller model with the target's tokenizer (draft_model.py);
- MTP: the checkpoint's next-token-prediction modules over the target's hidden states
  (mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.proposal import ProposalStep
from kvserve.spec_decode.suffix import SuffixProposer


def make_context_proposer(config: SpeculativeConfig):
    """The proposer over a request's own tokens `config.method` names: `propose(request_id,
    tokens, num_prompt_tokens)` -> drafts, `finish(request_id)`, and (suffix) `follow`, told of
    requests on steps where none is asked to propose."""
    if config.method == "suffix":
        return SuffixProposer(config.num_speculative_tokens,
                              config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                         config.num_speculative_tokens)


class ContextProposals:
    """ngram and suffix drafts: looked up in the request's own tokens (and, suffix, in recent
    requests' outputs), which every request that sampled joins whether it drafts or not."""

    keeps_forward = False

    def __init__(self, config: SpeculativeConfig, proposer=None):
        self.proposer = proposer or make_context_proposer(config)
        self._follow = getattr(self.proposer, "follow", None)

    def propose(self, step: ProposalStep) -> dict[str, list[int]]:
        drafts = {}
        for request_id in step.sampled:
            request = step.requests[request_id]
            limit = step.limits.get(request_id, 0)
            tokens, prompt = request.all_token_ids, len(request.prompt_token_ids)
            if limit > 0:
                drafts[request_id] = self.proposer.propose(request_id, tokens, prompt)[:limit]
            elif self._follow is not None:
                self._follow(request_id, tokens, prompt)
        return drafts

    def finish(self, request_id: str) -> None:
        self.proposer.finish(request_id)

    def take_forwards(self) -> list[tuple[int, float]]:
        return []


class DraftModelProposals:
    """A draft model's drafts, one batched forward per draft position for the requests
    allowed some (draft_model.py keeps each request's draft KV between steps)."""

    keeps_forward = False

    def __init__(self, proposer):
        self.proposer = proposer

    def propose(self, step: ProposalStep) -> dict[str, list[int]]:
        items = [(request_id, step.requests[request_id].all_token_ids, limit)
                 for request_id, limit in step.limits.items()
                 if limit > 0 and request_id in step.sampled]
        return {request_id: drafts for request_id, drafts
                in self.proposer.propose_batch(items).items() if drafts} if items else {}

    def finish(self, request_id: str) -> None:
        self.proposer.finish(request_id)

    def take_forwards(self) -> list[tuple[int, float]]:
        forwards, self.proposer.forwards = self.proposer.forwards, []
        return forwards


def make_worker_proposer(config: SpeculativeConfig, worker_context):
    """The worker's proposer for `config`. `worker_context`: what a model-backed proposer
    needs of the worker (`ProposerContext`)."""
    if config.method == "draft_model":
        from kvserve.spec_decode.draft_model import DraftModelProposer

        context = worker_context
        proposer = DraftModelProposer(
            config.model, config.num_speculative_tokens,
            target_vocab_size=context.vocab_size,
            target_tokenizer_source=context.model_source, dtype=context.dtype,
            device=context.device, attention_backend=context.attention_backend,
            use_cpu_kernels=context.use_cpu_kernels,
            quantization=config.quantization or context.quantization,
            block_size=context.block_size, target_num_blocks=context.num_blocks,
            max_num_seqs=context.max_num_seqs)
        proposer.profile()
        return DraftModelProposals(proposer)
    if config.method == "mtp":
        from kvserve.spec_decode.mtp import MTPProposer

        return MTPProposer(worker_context.mtp, worker_context.model, worker_context.kv_dtype,
                           worker_context.num_blocks, worker_context.block_size,
                           worker_context.device)
    return ContextProposals(config)


@dataclass
class ProposerContext:
    """What a worker gives a model-backed proposer: the target's vocabulary, source, dtype and
    kernels, its KV pool's shape, and (MTP) the target and its loaded MTP modules."""

    vocab_size: int
    model_source: Any
    dtype: Any
    kv_dtype: Any
    device: str
    attention_backend: str
    use_cpu_kernels: bool
    quantization: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    model: Any = None
    mtp: Any = None
