"""The engine core's side of the worker protocol: each SchedulerOutput becomes the ExecuteStep
every worker gets, carrying only what the workers do not hold yet."""

from __future__ import annotations

import time

import msgspec

from kvserve.core.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.kv_transfer.base import KVConnectorMetadata
from kvserve.protocol.worker import ExecuteStep, LoRALoad, NewRequestData, ScheduledData


class StepEncoder:
    """Turns each SchedulerOutput into the ExecuteStep every worker gets, remembering what the
    workers already hold: a request's prompt and parameters, and its block ids so far."""

    def __init__(self, expert_report_interval_s: float | None = None) -> None:
        """`expert_report_interval_s`: how often a step asks for the experts' routed-token
        counts (a model with experts; None: never)."""
        # request id -> the block ids workers hold, per KV cache group
        self._sent_blocks: dict[str, list[list[int]]] = {}
        self._expert_interval = expert_report_interval_s
        self._next_expert_report = 0.0
        # LoRA adapters the workers load, or drop, with the next step they get
        self.lora_loads: list[LoRALoad] = []
        self.lora_unloads: list[int] = []

    def encode(self, scheduler_output: SchedulerOutput) -> ExecuteStep:
        new_requests, scheduled = [], []
        # first: a new request may reuse the id of one that finished in the step before
        for request_id in scheduler_output.finished_ids:
            self._sent_blocks.pop(request_id, None)
        for item in scheduler_output.scheduled:
            request = item.request
            sent = self._sent_blocks.get(request.request_id)
            if sent is None:
                new_requests.append(NewRequestData(request.request_id, request.prompt_token_ids,
                                                   request.sampling_params, request.lora_id,
                                                   request.pooling_params))
                sent = self._sent_blocks[request.request_id] = [
                    [] for _ in range(1 + len(item.group_block_ids))]
            (blocks, *others), reset = _tables_delta(sent, [item.block_ids,
                                                            *item.group_block_ids])
            scheduled.append(ScheduledData(request.request_id, item.token_ids,
                                           item.start_position, blocks, item.sample, reset,
                                           others, item.num_draft_tokens))
        return self._with_lora(ExecuteStep(
            new_requests, scheduled, list(scheduler_output.finished_ids),
            encode_connector_metadata(scheduler_output.kv_connector_metadata),
            report_expert_counts=self._expert_report_due(),
            draft_limits=scheduler_output.draft_limits))

    def _with_lora(self, step: ExecuteStep) -> ExecuteStep:
        """The step, carrying the adapter loads and unloads queued since the last one (loads
        run before the step's forward, so a request's first step finds its adapter)."""
        step.lora_loads, self.lora_loads = self.lora_loads, []
        step.lora_unloads, self.lora_unloads = self.lora_unloads, []
        return step

    def _expert_report_due(self) -> bool:
        if self._expert_interval is None:
            return False
        now = time.monotonic()
        if now < self._next_expert_report:
            return False
        self._next_expert_report = now + self._expert_interval
        return True

    def encode_alone(self, item: ScheduledRequest, draft_limit: int = 0) -> ExecuteStep:
        """One scheduled request again, on its own (after its batch raised): its prompt and
        whole block table, so the step is right whatever the failed one left applied."""
        request = item.request
        tables = [list(item.block_ids), *map(list, item.group_block_ids)]
        self._sent_blocks[request.request_id] = [list(table) for table in tables]
        return self._with_lora(ExecuteStep(
            [NewRequestData(request.request_id, request.prompt_token_ids,
                            request.sampling_params, request.lora_id,
                            request.pooling_params)],
            [ScheduledData(request.request_id, item.token_ids, item.start_position,
                           tables[0], item.sample, reset_blocks=True,
                           new_group_block_ids=tables[1:],
                           num_draft_tokens=item.num_draft_tokens)], [],
            draft_limits={request.request_id: draft_limit} if draft_limit else {}))


def _tables_delta(sent: list[list[int]], current: list[list[int]],
                  ) -> tuple[list[list[int]], bool]:
    """(block ids to send per KV cache group, whether they replace the workers' tables).
    Tables grow while a request runs; a preempted request comes back with new tables, and a
    sliding-window table's slid-out positions turn into the null block (once per block): then
    every group's table is sent whole."""
    grows = len(sent) == len(current) and all(
        len(now) >= len(held) and now[:len(held)] == held for held, now in zip(sent, current))
    if grows:
        added = [now[len(held):] for held, now in zip(sent, current)]
        for held, new in zip(sent, added):
            held.extend(new)
        return [list(new) for new in added], False
    sent[:] = [list(table) for table in current]
    return [list(table) for table in current], True


def encode_connector_metadata(metadata: KVConnectorMetadata | None) -> bytes | None:
    """The connector's metadata as it crosses to the workers (each decodes it as its
    connector's `metadata_type`)."""
    return None if metadata is None else msgspec.msgpack.encode(metadata)


def connector_step(metadata: KVConnectorMetadata) -> ExecuteStep:
    """A step that only carries connector metadata (work a finished request left, e.g. blocks
    to serve, sent at once rather than with the next scheduled step)."""
    return ExecuteStep([], [], [], encode_connector_metadata(metadata))
