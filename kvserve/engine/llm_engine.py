"""LLMEngine: the front-end of the engine. Requests in, RequestOutputs out.

It tokenizes and validates (a bad request never reaches the core), fans n > 1 out into
single-sample core requests, and turns the core's token deltas into text, stop strings,
logprobs and grouped outputs. The core (scheduler, KV manager, model) sits behind a client:
on this thread (`engine_core="thread"`) or in its own process (`"process"`); `step()` is one
core step either way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

from kvserve.engine.core_client import InprocClient, make_core_client
from kvserve.engine.input_processor import InputProcessor, PromptType
from kvserve.engine.lora_registry import LoadedLoRA, LoRARegistry, salted
from kvserve.engine.output_processor import RequestGroup, SampleState, StepProgress
from kvserve.engine.pooling import PoolingInputs, pooling_sampling_params
from kvserve.engine_config import EngineConfig
from kvserve.errors import (
    InvalidRequestError,
    RequestFailedError,
)
from kvserve.lora_request import LoRARequest
from kvserve.memory import return_freed_memory
from kvserve.model_source import resolve_model
from kvserve.outputs import RequestOutput
from kvserve.plugins import load_plugins
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.engine_core import (
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from kvserve.protocol.kv_transfer_params import KVTransferParams
from kvserve.sample.logits_processor import load_processor_classes
from kvserve.sampling_params import SamplingParams, fits_int64
from kvserve.tokenizer import load_tokenizer
from kvserve.weights import load_config
from kvserve.models.registry import check_architecture

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PreparedRequest", "PromptType", "RequestFailedError"]


@dataclass(frozen=True)
class PreparedRequest:
    """A tokenized, validated request, ready to enter the engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    priority: int
    arrival_time: float
    kv_transfer_params: KVTransferParams | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_id: int = 0  # its LoRA adapter's load (0: the base model)
    pooling_params: PoolingParams | None = None  # a pooling request's (--runner pooling)


class LLMEngine:
    def __init__(self, config: EngineConfig, warm_up: bool = False):
        self.config = config
        start = time.perf_counter()
        load_plugins()
        # a processor that cannot be imported fails here, before the core starts; the classes
        # check each request's arguments for them (`validate_params`)
        self.processor_classes = load_processor_classes(config.logits_processors)
        self.source = resolve_model(config.model)
        self.pooling = PoolingInputs(config, self.source)  # --runner pooling: its pooler config
        # an unsupported architecture fails now, not after the tokenizer (by name: this process
        # never imports the model code)
        model_config = load_config(self.source, check_architecture=check_architecture)
        # a process core loads the model while this process loads the tokenizer
        self.core = make_core_client(config, warm_up, wait=False)
        try:
            self.tokenizer = load_tokenizer(self.source)
            return_freed_memory()  # the vocabulary's parse garbage (~40 MB at 128K tokens)
            ready = self.core.ready
        except BaseException:
            self.core.shutdown()
            raise
        self.core_ready = ready  # what the core reports of itself: dtype, quantization, sizing
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len,
                                     self.processor_classes)
        self.loras = LoRARegistry(config, model_config, self.core)
        self.groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, SampleState] = {}  # child request id -> its state
        self._failures: list[tuple[str, RequestFailedError]] = []  # since take_failures()
        self.last_stats = SchedulerStats()
        # every changed request's totals after the last processed step, outputs or not
        self.last_progress: list[StepProgress] = []
        logger.info("engine ready in %.2fs: %s, core in a %s, max_model_len %d",
                    time.perf_counter() - start, self.source.name, config.engine_core,
                    self.max_model_len)

    @property
    def engine_core(self):
        """The EngineCore object when it runs in this process (tests and profiling look
        inside it); a process core has none here."""
        if not isinstance(self.core, InprocClient):
            raise AttributeError("the engine core runs in another process")
        return self.core.core

    def shutdown(self) -> None:
        """Stop the core (and its process, if it has one)."""
        self.core.shutdown()

    # ---- requests ------------------------------------------------------------------------
    def prepare_request(self, request_id: str, prompt: PromptType,
                        params: SamplingParams | None = None, priority: int = 0,
                        arrival_time: float | None = None,
                        kv_transfer_params: KVTransferParams | None = None,
                        cache_salt: str | None = None,
                        session_id: str | None = None,
                        lora: LoadedLoRA | None = None) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from any thread); raises
        InvalidRequestError if the request is bad. `kv_transfer_params`: disaggregated
        prefill/decode (kvserve/kv_transfer/). `cache_salt` (or a prompt dict's, as in
        vLLM): its prefix blocks are shared only with requests of the same salt.
        `session_id` (or a prompt dict's): its blocks are kept for the session's next turn
        (--kv-session-ttl). `lora`: the loaded adapter it runs (`self.loras`)."""
        self.pooling.check_generate()
        if not fits_int64(priority):
            raise InvalidRequestError("priority must fit in 64 bits", param="priority")
        params = (params or SamplingParams()).clone()
        prompt_text, prompt_ids = self.inputs.tokenize(prompt)
        max_tokens = self.inputs.validate(prompt_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if kv_transfer_params is not None and params.n != 1:
            raise InvalidRequestError("kv_transfer_params needs n = 1", param="n")
        if kv_transfer_params is not None and params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs cannot be combined with "
                                      "kv_transfer_params: the prompt's KV is computed "
                                      "elsewhere", param="prompt_logprobs")
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt") if cache_salt is None else cache_salt
            session_id = prompt.get("session_id") if session_id is None else session_id
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise InvalidRequestError("session_id must be a non-empty string",
                                      param="session_id")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string",
                                      param="cache_salt")
        if lora is not None and kv_transfer_params is not None:
            raise InvalidRequestError("LoRA adapters are not served disaggregated yet",
                                      param="kv_transfer_params")
        return PreparedRequest(request_id, prompt_text, prompt_ids, params, max_tokens, priority,
                               arrival, kv_transfer_params, salted(cache_salt, lora),
                               session_id, lora.lora_id if lora is not None else 0)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError (nothing queued) if bad.
        `lora_request`: its adapter, loaded first if it is not (as vLLM's offline API does)."""
        lora = self.loras.add(lora_request) if lora_request is not None else None
        self.add_prepared(self.prepare_request(request_id, prompt, params, priority,
                                               arrival_time, lora=lora))

    def prepare_pooling_request(self, request_id: str, prompt: PromptType,
                                pooling_params: PoolingParams | None = None,
                                priority: int = 0, arrival_time: float | None = None
                                ) -> PreparedRequest:
        """A pooling request (--runner pooling), tokenized and validated: its prompt may fill
        the whole context (nothing is generated after it)."""
        pooling_params = self.pooling.params(pooling_params)
        if not fits_int64(priority):
            raise InvalidRequestError("priority must fit in 64 bits", param="priority")
        prompt_text, prompt_ids = self.inputs.tokenize(prompt)
        self.inputs.validate_pooling(prompt_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        return PreparedRequest(request_id, prompt_text, prompt_ids, pooling_sampling_params(),
                               1, priority, arrival, pooling_params=pooling_params)

    def add_pooling_request(self, request_id: str, prompt: PromptType,
                            pooling_params: PoolingParams | None = None,
                            priority: int = 0) -> None:
        """Validate and queue a pooling request; InvalidRequestError (nothing queued) if bad."""
        self.add_prepared(self.prepare_pooling_request(request_id, prompt, pooling_params,
                                                       priority))

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a validated request, fanning n > 1 out into sibling requests."""
        request_id, params = prepared.request_id, prepared.params
        if prepared.lora_id and not self.loras.is_loaded(prepared.lora_id):
            raise LoRANotFoundError("the request's LoRA adapter was unloaded before it started",
                                    param="model")
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        group = RequestGroup(request_id, prepared.prompt, prepared.prompt_token_ids,
                             pooling=prepared.pooling_params is not None)
        requests = []
        for index in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + index
            if index:  # the samples share one prompt: the first scores it
                child_params.prompt_logprobs = None
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            state = SampleState(child_id, request_id, index, prepared.prompt_token_ids,
                                child_params, self.tokenizer, prepared.arrival_time)
            group.samples.append(state)
            requests.append(EngineCoreRequest(
                child_id, prepared.prompt_token_ids, child_params, prepared.max_tokens,
                prepared.priority, prepared.arrival_time,
                prepared.kv_transfer_params, prepared.cache_salt, prepared.session_id,
                prepared.lora_id, pooling_params=prepared.pooling_params))
        sent: list[str] = []
        try:
            for request in requests:
                self.core.add_request(request)
                sent.append(request.request_id)
        except (OverflowError, TypeError, ValueError) as exc:  # it cannot be encoded
            self.core.abort_requests(sent)
            raise InvalidRequestError(f"the request cannot be sent to the engine: {exc}") \
                from exc
        self.groups[request_id] = group
        for state in group.samples:
            self._samples[state.request_id] = state

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort user requests (all their samples) wherever they are; the core frees their
        blocks before its next step."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        children = []
        for request_id in request_ids:
            group = self.groups.get(request_id)
            if group is None:
                continue
            children += [s.request_id for s in group.samples if not s.finished]
            self._forget(request_id)
        self.core.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- the loop ------------------------------------------------------------------------
    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """One core step's worth of outputs: the RequestOutputs of requests that changed.
        With a process core, waits up to `timeout` seconds for the step (None: as long as it
        takes; an empty list after the timeout)."""
        core_outputs = self.core.get_outputs(timeout)
        if core_outputs is None:
            return []
        return self.process_outputs(core_outputs)

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        """Apply a step's deltas. A failure that belongs to one request (the core reported an
        error for it, or processing its output raised here) fails that request only: it is
        aborted and listed by `take_failures()`; the others go on."""
        if core_outputs.stats is not None:
            self.last_stats = core_outputs.stats
        now = time.monotonic()
        changed: dict[str, RequestGroup] = {}
        stopped_here: list[str] = []
        for delta in core_outputs.outputs:
            state = self._samples.get(delta.request_id)
            if state is None or state.finished:  # aborted, failed, or stopped by a string
                continue
            group = self.groups[state.group_id]
            if delta.finish_reason == "error":
                self._fail(state.group_id, RequestFailedError(delta.error))
                continue
            try:
                if state.add_delta(delta, now):
                    stopped_here.append(state.request_id)
            except Exception as exc:
                self._fail(state.group_id, RequestFailedError(
                    f"the engine failed while processing its output: "
                    f"{type(exc).__name__}: {exc}"))
                continue
            changed[state.group_id] = group
        self.core.abort_requests(stopped_here)
        groups = [group for group in changed.values() if group.request_id in self.groups]
        self.last_progress = [group.progress() for group in groups]
        outputs = [group.output() for group in groups]
        for group in groups:
            if group.finished:
                self._forget(group.request_id)
        return [output for output in outputs if output is not None]

    def take_failures(self) -> list[tuple[str, RequestFailedError]]:
        """(request id, error) of user requests failed by their own fault since the last call;
        they are already aborted and will produce no more outputs."""
        failures, self._failures = self._failures, []
        return failures

    def _fail(self, group_id: str, error: RequestFailedError) -> None:
        """Abort the user request `group_id` (all its samples) and record why."""
        logger.error("request %s failed: %s", group_id, error)
        self.abort_request(group_id)
        self._failures.append((group_id, error))

    def _forget(self, request_id: str) -> None:
        group = self.groups.pop(request_id)
        for state in group.samples:
            self._samples.pop(state.request_id, None)
