"""LLMEngine: requests in, RequestOutputs out. `step()` is schedule -> execute -> update.

Everything else (tokenizing, validation, fanning n > 1 out into sibling requests, stop strings)
happens at the edges of a step, never inside the model runner.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from kvserve.attention.kv_tensors import kv_bytes_per_block
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.model_runner import ModelRunner, ModelRunnerOutput
from kvserve.core.output_processor import RequestGroup, SampleState
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.core.threads import ThreadGovernor, env_allows as threads_env_allows
from kvserve.engine_config import EngineConfig
from kvserve.errors import ContextLengthExceededError, InvalidRequestError, KVServeError
from kvserve.kernels import autotune
from kvserve.model_source import resolve_model
from kvserve.models import load_model, resolve_dtype
from kvserve.outputs import RequestOutput
from kvserve.platform import configure_threads, default_dtype, kv_cache_dtype
from kvserve.sampling_params import SamplingParams
from kvserve.testing.faults import FaultInjector
from kvserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


class RequestFailedError(KVServeError):
    """The engine raised while running this request; other requests go on."""


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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        start = time.perf_counter()
        threads = configure_threads(config.num_threads)
        self.thread_governor = ThreadGovernor(
            threads, enabled=config.adaptive_threads and threads_env_allows())
        if not config.autotune:
            autotune.set_enabled(False)
        self.source = resolve_model(config.model)
        dtype = default_dtype(config.device) if config.dtype == "auto" else resolve_dtype(
            config.dtype)
        self.model, self.model_config = load_model(self.source, dtype, config.device,
                                                   config.attention_backend,
                                                   use_cpu_kernels=config.cpu_kernels,
                                                   quantization=config.quantization,
                                                   dtype_is_default=config.dtype == "auto")
        self.tokenizer = load_tokenizer(self.source)
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, config.dtype == "auto",
                                       config.device)
        if self.kv_dtype not in (dtype, torch.bfloat16):
            raise ValueError(f"a {self.kv_dtype} KV cache needs {self.kv_dtype} activations "
                             f"(they are {dtype})")
        num_blocks = self._num_kv_blocks(self.kv_dtype)
        self.max_model_len = self._max_model_len(num_blocks)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size,
                                         config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_num_partial_prefills=config.max_num_partial_prefills,
        ), self.kv_manager)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.device,
                                  config.seed, kv_dtype=self.kv_dtype)
        self.groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, SampleState] = {}  # child request id -> its state
        self._failures: list[tuple[str, RequestFailedError]] = []  # since take_failures()
        self.faults = FaultInjector.from_env()  # test-only; off unless its env var is set
        logger.info("engine ready in %.2fs: %s, %s, quantization %s, max_model_len %d, "
                    "%d threads", time.perf_counter() - start, self.source.name, dtype,
                    getattr(self.model, "quantization", "none"), self.max_model_len, threads)

    # ---- sizing --------------------------------------------------------------------------
    def _num_kv_blocks(self, dtype) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, dtype)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        else:
            num_blocks = self.config.kv_cache_bytes() // per_block
        if num_blocks < 1:
            raise ValueError("KV cache budget is smaller than one block")
        tokens = num_blocks * self.config.block_size
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)", num_blocks,
                    self.config.block_size, tokens, num_blocks * per_block / 2**20, dtype)
        return num_blocks

    def _max_model_len(self, num_blocks: int) -> int:
        context = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or context
        if wanted > context:
            raise ValueError(f"max_model_len {wanted} exceeds the model's context {context}")
        capacity = num_blocks * self.config.block_size
        if wanted > capacity:
            logger.warning("max_model_len lowered from %d to %d: the KV pool holds no more",
                           wanted, capacity)
            wanted = capacity
        return wanted

    # ---- requests ------------------------------------------------------------------------
    def prepare_request(self, request_id: str, prompt: PromptType,
                        params: SamplingParams | None = None, priority: int = 0,
                        arrival_time: float | None = None) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from any thread); raises
        InvalidRequestError if the request is bad."""
        params = (params or SamplingParams()).clone()
        prompt_text, prompt_ids = self._tokenize(prompt)
        max_tokens = self._validate(prompt_ids, params)
        params.all_stop_token_ids = set(params.stop_token_ids)
        if self.tokenizer.eos_token_id is not None:
            params.all_stop_token_ids.add(self.tokenizer.eos_token_id)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        return PreparedRequest(request_id, prompt_text, prompt_ids, params, max_tokens, priority,
                               arrival)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError (nothing queued) if bad."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, priority,
                                               arrival_time))

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a validated request, fanning n > 1 out into sibling requests."""
        request_id, params = prepared.request_id, prepared.params
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        group = RequestGroup(request_id, prepared.prompt, prepared.prompt_token_ids)
        for index in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + index
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            request = Request(child_id, prepared.prompt_token_ids, child_params,
                              prepared.max_tokens, prepared.priority, prepared.arrival_time)
            state = SampleState(request, request_id, index, self.tokenizer)
            group.samples.append(state)
            self._samples[child_id] = state
        self.groups[request_id] = group
        for state in group.samples:
            self.scheduler.add_request(state.request)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'",
                                      param="prompt")
        if isinstance(prompt, (list, tuple)):
            return None, self._token_ids(prompt)
        raise InvalidRequestError("a prompt is a string, a list of token ids, or a dict",
                                  param="prompt")

    @staticmethod
    def _token_ids(values) -> list[int]:
        if not isinstance(values, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in values):
            raise InvalidRequestError("prompt token ids must be a list of integers",
                                      param="prompt")
        return list(values)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Checks needing the model; returns the effective max_tokens."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary "
                                      f"[0, {vocab})", param="prompt")
        params.validate_for_vocab(vocab)
        if params.top_k >= vocab:  # keeps every token: the same as no top-k (and fits int64)
            params.top_k = 0
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context is "
                f"{self.max_model_len} tokens, leaving no room for output", param="prompt")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ContextLengthExceededError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the maximum context of {self.max_model_len} tokens", param="max_tokens")
        return params.max_tokens

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort user requests (all their samples) wherever they are; frees their blocks now."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self.groups.pop(request_id, None)
            if group is None:
                continue
            for state in group.samples:
                self.scheduler.finish_request(state.request.request_id,
                                              RequestStatus.FINISHED_ABORTED)
                self._samples.pop(state.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching; returns outputs of requests that changed.

        Failure isolation: an exception that belongs to one request fails that request only
        (its group is aborted and listed by `take_failures()`); the others go on. Work done per
        request (output processing) is guarded per request. The forward and sampling are
        batched, so when they raise, `_execute_isolated` re-runs each scheduled request alone to
        find the culprit. An exception in scheduling or bookkeeping is not attributable and
        propagates to the caller.
        """
        self.thread_governor.tick()
        scheduler_output = self.scheduler.schedule()
        runner_output = self._execute(scheduler_output)
        self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        changed: dict[str, RequestGroup] = {}
        for item in scheduler_output.scheduled:
            request = item.request
            if not item.sample or request.request_id not in runner_output.sampled_token_ids:
                continue
            state = self._samples.get(request.request_id)
            if state is None:  # its group failed earlier in this step
                continue
            try:
                self.faults.maybe_raise("output", [self.groups[state.group_id].prompt])
                token = runner_output.sampled_token_ids[request.request_id]
                stop = state.add_token(token, runner_output.logprobs.get(request.request_id))
            except Exception as exc:
                self._fail(request.request_id, "processing its output", exc)
                continue
            if stop is not None and not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            changed[state.group_id] = self.groups[state.group_id]
        outputs = [group.output() for group in changed.values()
                   if group.request_id in self.groups]
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
        return outputs

    def take_failures(self) -> list[tuple[str, RequestFailedError]]:
        """(request id, error) of user requests failed by their own fault since the last call;
        they are already aborted and will produce no more outputs."""
        failures, self._failures = self._failures, []
        return failures

    def _prompts(self, scheduled) -> Iterator[str | None]:
        """Lazily: the fault hook only walks them when it is on, so a normal step pays nothing."""
        return (self.groups[state.group_id].prompt for state in
                (self._samples.get(item.request.request_id) for item in scheduled) if state)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            self.faults.maybe_raise("execute", self._prompts(scheduler_output.scheduled))
            return self.runner.execute(scheduler_output)
        except Exception:
            logger.exception("batched step of %d requests failed; re-running them one by one",
                             len(scheduler_output.scheduled))
            return self._execute_isolated(scheduler_output)

    def _execute_isolated(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Re-run each scheduled request alone after the batch raised. Safe to repeat: KV slots
        are allocated and `num_computed_tokens` has not moved, so a re-run rewrites the same
        KV positions. Requests that raise alone fail; if none does, the batch as a whole was at
        fault and everyone simply got their results the slow way. (A seeded request whose
        generator was drawn from before the batch raised may sample differently.)"""
        merged = ModelRunnerOutput({}, {})
        for item in scheduler_output.scheduled:
            try:
                self.faults.maybe_raise("execute", self._prompts([item]))
                result = self.runner.execute(SchedulerOutput(scheduled=[item]))
            except Exception as exc:
                self._fail(item.request.request_id, "running it", exc)
                continue
            merged.sampled_token_ids.update(result.sampled_token_ids)
            merged.logprobs.update(result.logprobs)
        return merged

    def _fail(self, child_id: str, stage: str, exc: Exception) -> None:
        """Abort the user request owning sample `child_id` and record why."""
        state = self._samples.get(child_id)
        if state is None:
            return
        logger.error("request %s failed while %s: %s: %s", state.group_id, stage,
                     type(exc).__name__, exc)
        self.abort_request(state.group_id)
        self._failures.append((state.group_id, RequestFailedError(
            f"the engine failed while {stage}: {type(exc).__name__}: {exc}")))

    def _forget(self, request_id: str) -> None:
        group = self.groups.pop(request_id)
        for state in group.samples:
            self._samples.pop(state.request.request_id, None)
