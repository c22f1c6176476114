"""Messages between the engine core and its workers (the `mp` executor), as msgspec structs.

A request's prompt and sampling parameters cross once (`NewRequestData`); after that each step
sends, per scheduled request, the token ids it computes (one per decode), the block ids added
since the last step (the whole list again only after a preemption) and whether it samples.
Rank 0 answers with the sampled tokens.
"""

from __future__ import annotations

import msgspec

from kvserve.config import ModelConfig
from kvserve.core.model_runner import ModelRunnerOutput
from kvserve.sampling_params import SamplingParams

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


class NewRequestData(msgspec.Struct, **_WIRE):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class ScheduledData(msgspec.Struct, **_WIRE):
    request_id: str
    token_ids: list[int]
    start_position: int
    new_block_ids: list[int]
    sample: bool
    reset_blocks: bool = False  # new_block_ids is the whole table (after a preemption)


class InitKVCache(msgspec.Struct, tag=True, **_WIRE):
    num_blocks: int
    block_size: int


class ExecuteStep(msgspec.Struct, tag=True, **_WIRE):
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledData]
    finished_ids: list[str]


class StopWorker(msgspec.Struct, tag=True, **_WIRE):
    pass


class WorkerReady(msgspec.Struct, tag=True, **_WIRE):
    rank: int
    model_config: ModelConfig  # the rank's shard (its heads): sizes its KV blocks
    dtype: str
    kv_dtype: str
    quantization: str


class KVCacheReady(msgspec.Struct, tag=True, **_WIRE):
    rank: int


class StepResult(msgspec.Struct, tag=True, **_WIRE):
    output: ModelRunnerOutput


class WorkerFailed(msgspec.Struct, tag=True, **_WIRE):
    rank: int
    message: str


ToWorker = InitKVCache | ExecuteStep | StopWorker
FromWorker = WorkerReady | KVCacheReady | StepResult | WorkerFailed
