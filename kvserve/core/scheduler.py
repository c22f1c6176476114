"""The phase-free continuous-batching scheduler.

Each step hands out a token budget so that every request's `num_computed_tokens` catches up with
its `num_tokens`: a decode needs 1, a prompt needs the rest of its prompt (chunked to the budget),
a preempted request needs everything again minus its prefix hits. Running requests go first, then
waiting ones in policy order (FCFS or priority). When the pool runs dry, the lowest-priority /
latest running request is preempted by recompute: blocks freed, back to waiting, nothing lost.

With pipeline stages the engine keeps up to `pipeline_depth` batches in flight. A request in an
unfinished batch (`in_flight`) is neither scheduled again nor preempted until its batch's
results are in, and each batch takes at most 1/depth of the requests, so the next batch has
requests of its own to run while the stages hold the earlier ones.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Literal

from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler_interface import SchedulerInterface
from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, overrides
from kvserve.protocol.worker import KVConnectorOutput, ModelRunnerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # prompts that may be prefilled in one step (None: as many as the budget allows). One at a
    # time serves a burst of short prompts in order: each gets its first token after its own
    # prefill instead of everyone's (see docs/performance-journal.md, s3).
    max_num_partial_prefills: int | None = None
    pipeline_depth: int = 1  # batches the engine may keep in flight (pipeline stages)

    def __post_init__(self):
        if self.max_num_partial_prefills is not None and self.max_num_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills must be at least 1 (or None: no cap)")
        if self.pipeline_depth < 1:
            raise ValueError("pipeline_depth must be at least 1")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start_position: int  # num_computed_tokens when scheduled
    block_ids: list[int]  # its table in KV cache group 0
    sample: bool  # this chunk reaches the end of the request's tokens: sample the next one
    # the hybrid layout: its tables in groups 1.. (empty with one group)
    group_block_ids: list[list[int]] = field(default_factory=list)
    num_draft_tokens: int = 0  # the last this many of its new tokens are drafts to verify

    @property
    def token_ids(self) -> list[int]:
        start = self.start_position
        tokens = self.request.all_token_ids[start:start + self.num_new_tokens
                                            - self.num_draft_tokens]
        if self.num_draft_tokens:
            tokens += self.request.spec_token_ids[:self.num_draft_tokens]
        return tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # since the last step (runner cleanup)
    kv_connector_metadata: KVConnectorMetadata | None = None  # the connector's, for the workers
    # speculative decoding: drafts the workers' proposer may make after this step, per request
    # that samples in it (set by the engine core's drafter)
    draft_limits: dict[str, int] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler(SchedulerInterface):
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 connector: KVConnectorBase | None = None):
        self.config = config
        self.kv = kv_manager
        self.connector = connector  # a KV connector's scheduler side, or None
        if connector is not None and overrides(connector, "on_evict"):
            kv_manager.pool.record_evictions()
        self.loading: dict[str, Request] = {}  # loading their KV between steps
        self.held: dict[str, Request] = {}  # finished, blocks kept for the connector (sends)
        # waiting for their grammar to compile (structured output), with their queue keys
        self.compiling: dict[str, tuple[tuple, Request]] = {}
        self.load_failures: list[tuple[str, str]] = []  # (id, why) since the engine last looked
        self.waiting: list[tuple[tuple, Request]] = []  # sorted by policy key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0
        self.in_flight: set[str] = set()  # ids of requests in batches not yet updated
        self._batch_seq_limit: int | None = None  # this step's cap on requests (pipelines)

    # ---- queue management ----------------------------------------------------------------
    def _key(self, request: Request, front: bool = False) -> tuple:
        order = -next(self._arrivals) if front else next(self._arrivals)
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time, order)
        return (order,)

    def add_request(self, request: Request, wait_for_grammar: bool = False) -> None:
        """Queue a request; one that must wait for its grammar stays out of the queue (and
        keeps its place in it) until `grammar_ready`."""
        self.requests[request.request_id] = request
        if wait_for_grammar:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.compiling[request.request_id] = (self._key(request), request)
            return
        bisect.insort(self.waiting, (self._key(request), request), key=lambda item: item[0])

    def grammar_ready(self, request_id: str) -> None:
        key, request = self.compiling.pop(request_id)
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, (key, request), key=lambda item: item[0])

    def _push_front(self, request: Request) -> None:
        """A preempted request goes back ahead of later arrivals (FCFS) or by priority."""
        bisect.insort(self.waiting, (self._key(request, front=True), request),
                      key=lambda item: item[0])

    def _remove_waiting(self, request: Request) -> None:
        self.waiting = [item for item in self.waiting if item[1] is not request]

    @property
    def num_waiting(self) -> int:
        """Waiting to be scheduled, those waiting for their KV from a prefill engine or for
        their grammar included (as vLLM counts them)."""
        return len(self.waiting) + len(self.loading) + len(self.compiling)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.compiling)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def mark_in_flight(self, output: SchedulerOutput) -> None:
        self.in_flight.update(item.request.request_id for item in output.scheduled)

    def mark_landed(self, output: SchedulerOutput) -> None:
        self.in_flight.difference_update(item.request.request_id for item in output.scheduled)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self.config.max_num_batched_tokens
        self._batch_seq_limit = self._seq_limit()
        budget = self._schedule_running(output, budget)
        if not output.preempted:
            self._schedule_waiting(output, budget, self._prefill_slots(output))
        now = time.monotonic()
        for item in output.scheduled:
            if item.request.times.first_scheduled is None:
                item.request.times.first_scheduled = now
        if self.connector is not None:
            self._drain_evictions()
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _seq_limit(self) -> int | None:
        """Requests one batch may take when several are in flight: an even share of those
        alive, so each stage of the pipeline has a batch of its own."""
        depth = self.config.pipeline_depth
        if depth == 1:
            return None
        return max(1, math.ceil((len(self.running) + len(self.waiting)) / depth))

    def _batch_full(self, output: SchedulerOutput) -> bool:
        return self._batch_seq_limit is not None and len(output.scheduled) >= self._batch_seq_limit

    def _tokens_wanted(self, request: Request, budget: int) -> int:
        """Its tokens without KV yet, drafts included, within the budget and max_model_len."""
        remaining = request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens
        return max(0, min(remaining, budget, self.config.max_model_len - request.num_computed_tokens))

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        for request in list(self.running):
            if budget <= 0 or self._batch_full(output):
                break
            if request.status != RequestStatus.RUNNING or request.request_id in self.in_flight:
                continue  # preempted earlier in this step to make room, or its batch is out
            num_new = self._tokens_wanted(request, budget)
            if num_new == 0:
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._pick_victim()
                budget += self._preempt(victim, output)
                if victim is request:
                    break
            else:
                self._record(output, request, num_new)
                budget -= num_new
        return budget

    def _pick_victim(self) -> Request:
        """Never a request whose batch is still out (the request being scheduled never is)."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request, output: SchedulerOutput) -> int:
        """Free the request's blocks and requeue it; returns budget refunded if it was already
        scheduled this step."""
        refund = 0
        for item in list(output.scheduled):
            if item.request is request:
                output.scheduled.remove(item)
                refund = item.num_new_tokens
        self.running.remove(request)
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        output.preempted.append(request)
        self._push_front(request)
        return refund

    def _prefill_slots(self, output: SchedulerOutput) -> int | None:
        """How many waiting requests may still start a prefill in this step."""
        limit = self.config.max_num_partial_prefills
        if limit is None:
            return None
        prefilling = sum(1 for item in output.scheduled
                         if item.start_position < item.request.num_prompt_tokens)
        return max(0, limit - prefilling)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int,
                          prefill_slots: int | None = None) -> None:
        skipped: list[tuple[tuple, Request]] = []
        while (self.waiting and budget > 0
               and len(self.running) + len(self.loading) < self.config.max_num_seqs
               and prefill_slots != 0 and not self._batch_full(output)):
            key, request = self.waiting[0]
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_external, load_async = self._external_tokens(request, num_hit)
            if load_async:
                if not self._start_load(request, computed_blocks, num_hit, num_external):
                    break
                continue
            num_computed = num_hit + num_external
            if self.kv.is_computing_elsewhere(request, num_computed):
                skipped.append(self.waiting.pop(0))
                continue
            num_new = request.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_external + num_new, computed_blocks):
                break
            self.waiting.pop(0)
            self.kv.record_prefix_lookup(request.num_tokens, num_hit,
                                     request.session_id is not None)
            request.num_computed_tokens = num_hit
            if num_external:  # loaded within this step, before its forward reads them
                self.connector.update_state_after_alloc(
                    request, self.kv.block_ids(request.request_id), num_external)
                request.num_computed_tokens = num_computed
                request.num_transferred_tokens += num_external
            self.kv.mark_pending(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._record(output, request, num_new)
            budget -= num_new
            if prefill_slots is not None:
                prefill_slots -= 1
        for item in skipped:
            bisect.insort(self.waiting, item, key=lambda entry: entry[0])

    # ---- KV from elsewhere (a KV connector) ---------------------------------------------------
    def _external_tokens(self, request: Request, num_hit: int) -> tuple[int, bool]:
        """Tokens after the prefix hit the connector provides, and whether they load between
        steps; never all of the request's tokens when they load within the step (one is
        always computed here, for its logits)."""
        if self.connector is None or request.skips_prefix_cache:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_external <= 0:
            return 0, False
        if load_async:
            return num_external, True
        return min(num_external, request.num_tokens - 1 - num_hit), False

    def _start_load(self, request: Request, computed_blocks, num_hit: int,
                    num_external: int) -> bool:
        """Give the request blocks for all its tokens, its prefix-cache hit first, and let
        the connector load the external ones while it waits; False (nothing changed) when the
        pool cannot hold them yet."""
        if not self.kv.allocate_slots(request, request.num_tokens - num_hit, computed_blocks):
            return False
        self.waiting.pop(0)
        self.kv.record_prefix_lookup(request.num_tokens, num_hit,
                                     request.session_id is not None)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:  # a preempted request reported its hit already
            request.num_cached_tokens = num_hit
        request.num_external_tokens = num_external
        self.loading[request.request_id] = request
        self.connector.update_state_after_alloc(
            request, self.kv.block_ids(request.request_id), num_external)
        return True

    def update_connector_output(self, output: KVConnectorOutput) -> int:
        """Transfers every rank finished: loaded requests run, held requests whose blocks are
        no longer read are freed (how many)."""
        self.connector.update_connector_output(output)
        self.finish_loads([(request_id, output.load_errors.get(request_id))
                           for request_id in output.finished_recving])
        freed = 0
        for request_id in output.finished_sending:
            request = self.held.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
                freed += 1
        return freed

    def finish_loads(self, finished: list[tuple[str, str | None]]) -> None:
        """Loaded requests run with their external tokens computed (never the last one: it is
        computed here, for its logits); failed ones compute from their prefix-cache hit on.
        An aborted request's blocks are freed only now: the load wrote into them until it
        ended."""
        for request_id, error in finished:
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            if request.is_finished:
                self.kv.free(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if error is None:
                loaded = min(request.num_computed_tokens + request.num_external_tokens,
                             request.num_tokens - 1)
                if getattr(self.connector, "loads_are_cache_hits", False):  # offload tiers
                    if not request.num_output_tokens:  # its first admission (not a resume)
                        request.num_cached_tokens += loaded - request.num_computed_tokens
                else:
                    request.num_transferred_tokens = loaded - request.num_computed_tokens
                request.num_computed_tokens = loaded
            else:
                self.load_failures.append((request_id, error))

    def _drain_evictions(self) -> None:
        """Blocks the prefix cache dropped since the last step, for a connector that asks."""
        evicted = self.kv.pool.take_evictions()
        if evicted:
            self.connector.on_evict([block_hash for block_hash, _ in evicted],
                                    [block_id for _, block_id in evicted])

    def _record(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        first, *others = self.kv.group_block_ids(request.request_id)
        num_drafts = max(0, start + num_new - request.num_tokens)
        output.scheduled.append(ScheduledRequest(
            request=request, num_new_tokens=num_new, start_position=start,
            block_ids=first, sample=start + num_new >= request.num_tokens,
            group_block_ids=others, num_draft_tokens=num_drafts))

    # ---- results ---------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append each sampling request's new tokens (0..k+1 of them)
        and apply token-level stops after each, dropping the tokens after a stop. Positions the
        runner rejected (drafts) step `num_computed_tokens` back before any block is cached,
        so they never enter the prefix cache. Returns the requests that finished."""
        finished = []
        now = time.monotonic()
        sampled = runner_output.sampled_token_ids
        rejected = runner_output.num_rejected_tokens
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue
            request.num_computed_tokens += item.num_new_tokens - rejected.get(
                request.request_id, 0)
            request.spec_token_ids = []
            self.kv.cache_computed_blocks(request)
            self.kv.release_unneeded(request)  # window blocks behind the next query
            if request.pooling_params is not None:  # done when its prompt is, sampling nothing
                if item.sample:
                    request.pooling_output = runner_output.pooler_output.get(request.request_id)
                    self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    finished.append(request)
                continue
            new_tokens = sampled.get(request.request_id) if item.sample else None
            if not new_tokens:
                continue
            if request.times.first_token is None:
                request.times.first_token = now
            request.times.last_token = now
            status = self._append_until_stop(request, new_tokens)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        return finished

    def _append_until_stop(self, request: Request, tokens: list[int]) -> RequestStatus | None:
        """Append tokens one at a time, as if each came in its own step; the stop status of the
        first that ends the request (the rest are dropped)."""
        for token in tokens:
            request.append_output_token(token)
            status = self._check_stop(request)
            if status is not None:
                return status
        return None

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if token in params.all_stop_token_ids:
                if not params.ignore_eos or token in params.stop_token_ids:
                    request.stop_reason = token if token in params.stop_token_ids else None
                    return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, length or abort) a request wherever it is; frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KV
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            del self.compiling[request_id]
        elif not request.is_finished and not loading:
            self._remove_waiting(request)
        request.status = status
        request.times.finished = time.monotonic()
        delay_free = False
        if self.connector is not None:
            delay_free, request.kv_handle = self.connector.request_finished(
                request, self.kv.block_ids(request_id))
        if delay_free and not loading:  # freed when every worker reported it sent
            self.held[request_id] = request
        elif not loading:  # a load still writes into its blocks: freed when it ends
            self.kv.free(request)
        self._finished_since_step.append(request_id)
        return request
