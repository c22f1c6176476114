"""Messages between the engine core and its workers, as msgspec structs: the contract every
executor carries (in-process for `uni`, ZeroMQ for `mp`, actor calls for `ray`).

A request's prompt and sampling parameters cross once (`NewRequestData`); after that each step
sends, per scheduled request, the token ids it computes (one per decode), the block ids added
since the last step (the whole list again only after a preemption) and whether it samples.
The output rank answers with the sampled tokens (`ModelRunnerOutput`). With a KV connector a
step also carries its metadata (what the workers load, save or serve; opaque bytes here, the
connector's own struct), and every rank reports the transfers it finished (`KVReport`) after
a step, only when there are some.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvserve.config import ModelConfig
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and rank, plus the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class ModelRunnerOutput:
    """A step's samples, per request that sampled: a list of 0..k+1 new tokens each (one for a
    plain decode; a speculative step adds the accepted drafts and the bonus token), with their
    logprobs when asked (one entry per token). `num_rejected_tokens`: scheduled positions whose
    KV is not kept (rejected drafts), so `num_computed_tokens` steps back by that many; those
    positions never enter the prefix cache and are simply overwritten later."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]
    num_rejected_tokens: dict[str, int] = field(default_factory=dict)
    # when the step asked (ExecuteStep.report_expert_counts): per MoE layer of the output
    # rank's stage, the tokens routed to each expert so far
    expert_counts: dict[int, list[int]] = field(default_factory=dict)
    # speculative decoding: the worker's proposer's drafts for each request that sampled and
    # was allowed some (ExecuteStep.draft_limits), for its next step; and the drafting
    # forwards it ran (a draft model's, MTP's), (tokens, seconds) each, outside the target's
    # step time
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_forwards: list[tuple[int, float]] = field(default_factory=list)
    # prompt logprobs (SamplingParams.prompt_logprobs): per request whose prompt positions this
    # step computed, the first prompt position it scored the token after, and each position's
    # entry (the logprob of prompt token p + 1 from position p's logits)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # pooling requests whose prompt this step completed: each one's pooled vector
    pooler_output: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls({}, {})

    def merge(self, other: "ModelRunnerOutput") -> None:
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.num_rejected_tokens.update(other.num_rejected_tokens)
        self.expert_counts.update(other.expert_counts)
        self.draft_token_ids.update(other.draft_token_ids)
        self.draft_forwards.extend(other.draft_forwards)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.pooler_output.update(other.pooler_output)


class KVConnectorOutput(msgspec.Struct, **_WIRE):
    """Transfers a KV connector's worker side finished: requests whose held blocks it no longer
    reads (sent, or the hold expired), and requests whose loads ended (`load_errors`: those
    that failed, and why). From one rank, or every rank's merged (kv_transfer.aggregator)."""

    finished_sending: list[str] = []
    finished_recving: list[str] = []
    load_errors: dict[str, str] = {}

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving)


# The block id a table holds where a request's block was released (a sliding window's or the
# attention sinks' evicted positions): the pool never hands it out (kv_cache/block_pool.py).
NULL_BLOCK_ID = 0


class NewRequestData(msgspec.Struct, **_WIRE):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_id: int = 0  # the LoRA adapter it runs (0: the base model)
    pooling_params: PoolingParams | None = None  # a pooling request's (--runner pooling)


class LoRALoad(msgspec.Struct, **_WIRE):
    """An adapter every worker loads into a free slot before the step runs."""

    lora_id: int
    path: str


class ScheduledData(msgspec.Struct, **_WIRE):
    request_id: str
    token_ids: list[int]
    start_position: int
    new_block_ids: list[int]
    sample: bool
    reset_blocks: bool = False  # new_block_ids is the whole table (after a preemption)
    # the hybrid KV layout (several KV cache groups): groups 1.. likewise (new_block_ids is
    # group 0's; reset_blocks covers every group)
    new_group_block_ids: list[list[int]] = []
    num_draft_tokens: int = 0  # speculative decoding: the last this many tokens are drafts


class InitKVCache(msgspec.Struct, tag=True, **_WIRE):
    num_blocks: int
    block_size: int
    # the hybrid layout (kv_cache/spec.py `layer_placement`): per layer, its KV cache group and
    # its KV tensor; empty: one group, a tensor per layer
    layer_groups: list[int] = []
    layer_tensors: list[int] = []


class ExecuteStep(msgspec.Struct, tag=True, **_WIRE):
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledData]
    finished_ids: list[str]
    # the KV connector's metadata for this step, msgpack of its own struct (None: nothing)
    kv_connector_metadata: bytes | None = None
    report_expert_counts: bool = False  # the output rank adds its experts' routed tokens
    # speculative decoding: how many drafts the output rank's proposer may make, after this
    # step, for each request that samples in it (the engine core's allocation: what pays)
    draft_limits: dict[str, int] = {}
    # LoRA: adapters to load before this step, and adapters no request runs any more
    lora_loads: list[LoRALoad] = []
    lora_unloads: list[int] = []


class StopWorker(msgspec.Struct, tag=True, **_WIRE):
    pass


class WorkerReady(msgspec.Struct, tag=True, **_WIRE):
    rank: int
    model_config: ModelConfig  # the rank's shard (its heads): sizes its KV blocks
    dtype: str
    kv_dtype: str
    quantization: str
    # bytes one token keeps in one layer's KV page, the largest of the rank's layers (each
    # declares its KVPageLayout): what the engine core sizes the pool with
    kv_page_bytes: int = 0


class KVCacheReady(msgspec.Struct, tag=True, **_WIRE):
    rank: int
    # what the KV connector's scheduler side needs from this rank (e.g. where it serves KV)
    kv_connector_info: dict | None = None


class StepResult(msgspec.Struct, tag=True, **_WIRE):
    output: ModelRunnerOutput


class KVReport(msgspec.Struct, tag=True, **_WIRE):
    """A rank's finished transfers, sent after a step only when there are some."""

    rank: int
    output: KVConnectorOutput


class WorkerFailed(msgspec.Struct, tag=True, **_WIRE):
    rank: int
    message: str


ToWorker = InitKVCache | ExecuteStep | StopWorker
FromWorker = WorkerReady | KVCacheReady | StepResult | KVReport | WorkerFailed
