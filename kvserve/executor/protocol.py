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
from kvserve.core.scheduler import SchedulerOutput
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


class StepEncoder:
    """Turns each SchedulerOutput into the ExecuteStep every worker gets, remembering what the
    workers already hold: a request's prompt and parameters, and its block ids so far."""

    def __init__(self) -> None:
        self._sent_blocks: dict[str, list[int]] = {}  # request id -> block ids workers hold

    def encode(self, scheduler_output: SchedulerOutput) -> ExecuteStep:
        new_requests, scheduled = [], []
        for item in scheduler_output.scheduled:
            request = item.request
            sent = self._sent_blocks.get(request.request_id)
            if sent is None:
                new_requests.append(NewRequestData(request.request_id, request.prompt_token_ids,
                                                   request.sampling_params))
                sent = self._sent_blocks[request.request_id] = []
            blocks, reset = _block_delta(sent, item.block_ids)
            scheduled.append(ScheduledData(request.request_id, item.token_ids,
                                           item.start_position, blocks, item.sample, reset))
        for request_id in scheduler_output.finished_ids:
            self._sent_blocks.pop(request_id, None)
        return ExecuteStep(new_requests, scheduled, list(scheduler_output.finished_ids))


def _block_delta(sent: list[int], current: list[int]) -> tuple[list[int], bool]:
    """(block ids to send, whether they replace the workers' table). Tables only grow while a
    request runs; a preempted request comes back with a new table, sent whole."""
    if len(current) >= len(sent) and current[:len(sent)] == sent:
        added = current[len(sent):]
        sent.extend(added)
        return list(added), False
    sent[:] = current
    return list(current), True
