"""EngineCore: the scheduler, the KV manager and the executor; requests in, deltas out.

It knows token ids only: no text, no tokenizer, no n > 1 (the front-end fans samples out into
single-sample requests and detokenizes). `step()` is schedule -> execute -> update and returns
one EngineCoreOutputs: for each request that sampled, its new token, and its finish if it
finished. The same object runs on a thread of the front-end or in its own process
(core/core_process.py).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Iterable

from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.kv_cache.spec import (
    KVCacheGroup,
    SlidingWindowSpec,
    StreamingSpec,
    kv_cache_groups,
    layer_placement,
    layers_per_block,
    pool_token_capacity,
    streaming_spec,
)
from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.core.step_encoder import StepEncoder, connector_step
from kvserve.core.step_ledger import make_step_ledger
from kvserve.core.threads import ThreadGovernor
from kvserve.core.threads import env_allows as threads_env_allows
from kvserve.engine_config import EngineConfig
from kvserve.executor import Executor, make_executor
from kvserve.kernels import autotune
from kvserve.kernels.reference import kv_dtype_name
from kvserve.memory import check_fits, return_freed_memory
from kvserve.kv_events import make_kv_event_source
from kvserve.kv_transfer.aggregator import KVOutputAggregator
from kvserve.model_source import resolve_model
from kvserve.platform import configure_threads
from kvserve.plugins import load_plugins
from kvserve.protocol.engine_core import (
    CoreReady,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from kvserve.protocol.worker import KVCacheReady, LoRALoad, ModelRunnerOutput
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import (
    SpeculativeConfig,
    mtp_module_count,
    parse_speculative_config,
)
from kvserve.spec_decode.cost import attention_reads
from kvserve.spec_decode.drafter import Drafter
from kvserve.structured_output.compiler import shared_compiler
from kvserve.structured_output.drafts import GrammarDrafts
from kvserve.structured_output.gate import GrammarGate
from kvserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "__warmup__"
LOAD_WAIT_SECONDS = 0.005  # an idle step's wait for a KV load to end
GRAMMAR_WAIT_SECONDS = 0.01  # an idle step's wait for a grammar compile to end
HOUSEKEEPING_SECONDS = 0.1  # how often an idle core holding blocks for the connector asks
# speculative decoding's price of attention reads: this many requests, each with a cached prefix
# of its own this long (or one block), computing this many new tokens a step (a verification of
# 3 drafts), over this many rounds (~0.8 s at start-up on Zen 4, with the curve's 0.4 s)
READ_PROFILE_REQUESTS, READ_PROFILE_CONTEXT, READ_PROFILE_QUERIES = 4, 256, 4
READ_PROFILE_ROUNDS = 6
EXPERT_REPORT_INTERVAL_S = 1.0  # how often a model with experts reports their routed tokens


class EngineCore:
    # what a UtilityCall may invoke: state queries and resets, never arbitrary attributes
    UTILITIES = ("reset_prefix_cache", "stats", "num_unfinished", "add_lora", "remove_lora")

    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        load_plugins()
        self.config = config
        start = time.perf_counter()
        threads = configure_threads(config.num_threads)
        self.thread_governor = ThreadGovernor(
            threads, enabled=config.adaptive_threads and threads_env_allows())
        if not config.autotune:
            autotune.set_enabled(False)
        self.executor = executor or make_executor(config)
        self.model_config = self.executor.model_config
        groups = self._kv_cache_groups()
        spec = parse_speculative_config(config.speculative_config)
        self.num_kv_blocks = self._num_kv_blocks(
            layers_per_block(groups, self.model_config.num_hidden_layers)
            + self._drafter_layers(spec))
        self.kv_manager = KVCacheManager(self.num_kv_blocks, config.block_size,
                                         config.enable_prefix_caching, groups)
        self.kv_manager.pin_sessions(config.kv_session_ttl, config.kv_session_max_fraction)
        self.max_model_len = self._max_model_len(self.kv_manager.pool.num_usable_blocks, groups)
        kv_ready = self.executor.initialize_kv_cache(
            self.num_kv_blocks, config.block_size,
            layer_placement(groups, self.model_config.num_hidden_layers) if len(groups) > 1
            else None)
        self.kv_events = make_kv_event_source(config.kv_events_config, self.kv_manager)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            # unchunked, a step takes a whole prompt: a budget below the longest one would
            # leave that prompt waiting forever
            max_num_batched_tokens=config.max_num_batched_tokens if config.enable_chunked_prefill
            else max(config.max_num_batched_tokens, self.max_model_len),
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_num_partial_prefills=config.max_num_partial_prefills,
            pipeline_depth=self.executor.max_concurrent_batches,
        ), self.kv_manager, self._make_kv_connector(kv_ready))
        self.kv_events.add_source(self.scheduler.connector)
        # a transfer is done when every rank reported it
        self.kv_reports = KVOutputAggregator(config.world_size)
        # what the workers hold: each step sends the rest (and, about once a second, asks a
        # model with experts for their routed-token counts, for /metrics)
        self.step_encoder = StepEncoder(
            EXPERT_REPORT_INTERVAL_S if self.model_config.num_experts else None)
        self._loras: set[int] = set()  # LoRA adapters the workers hold
        self._lora_unloading: set[int] = set()  # removed, waiting for their last requests
        self.drafter = self._make_drafter(spec) if spec is not None else None  # speculation
        # each step's tokens, FLOPs, bytes and time against the machine's roof (the doctor)
        self.step_ledger = make_step_ledger(
            self.model_config, self.executor.dtype, self.executor.quantization,
            self.executor.kv_page_bytes * self.model_config.num_hidden_layers) \
            if config.step_ledger else None
        self._step_started = 0.0  # when the step() now running began
        # batches submitted to a pipelined executor, oldest first, not yet collected
        self._batch_queue: deque[SchedulerOutput] = deque()
        self._failed: list[EngineCoreOutput] = []  # failures since the last step's outputs
        self._grammar_gate: GrammarGate | None = None  # built on the first constrained request
        self._step_costs: list | None = None  # steps' costs while profiling attention reads
        if self.drafter is not None:
            self._profile_step_costs()
        return_freed_memory()  # what loading parsed and dropped stays out of the serving RSS
        self.load_seconds = time.perf_counter() - start
        logger.info("engine core ready in %.2fs: %s, quantization %s, max_model_len %d, "
                    "%d threads", self.load_seconds, self.executor.dtype,
                    self.executor.quantization, self.max_model_len, threads)

    def _kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        model = self.model_config
        if self.config.streaming_window is not None:
            return self._streaming_groups()
        # the hybrid layout (a block table per group) where every stage holds every layer,
        # unless switched off
        groups = kv_cache_groups(model.sliding_windows, model.num_hidden_layers,
                                 self.config.block_size,
                                 hybrid=self.config.pipeline_parallel_size == 1
                                 and not self.config.disable_hybrid_kv_cache_manager)
        windowed = any(isinstance(group.spec, SlidingWindowSpec) for group in groups)
        if windowed and (self.config.kv_role or self.config.kv_transfer_config):
            raise ValueError(
                "KV transfer (--kv-role / --kv-transfer-config) is not built for models with "
                "sliding-window KV cache groups: their slid-out blocks are freed, and a "
                "transfer would carry them as empty")
        return groups

    def _streaming_groups(self) -> tuple[KVCacheGroup, ...]:
        """Attention sinks: every layer in one group under the streaming policy."""
        config, model = self.config, self.model_config
        if any(window is not None for window in model.sliding_windows):
            raise ValueError("--streaming-window is not built for models with sliding-window "
                             "layers of their own (their windows and the sinks' would mix)")
        if config.transfer_config() is not None:
            raise ValueError("--streaming-window and KV transfer or offload (--kv-role, "
                             "--kv-transfer-config, --kv-offload-*) do not combine: a "
                             "streaming request's window keys are rotated in place")
        if not config.enable_chunked_prefill:
            raise ValueError("--streaming-window needs chunked prefill: a prompt longer than "
                             "the window is computed a chunk at a time, the window sliding "
                             "between chunks")
        spec = streaming_spec(config.block_size, config.streaming_window,
                              config.streaming_sink_blocks)
        longest = spec.max_cached_tokens(config.max_num_batched_tokens)
        if longest > model.max_position_embeddings:
            raise ValueError(
                f"--streaming-window {config.streaming_window}: a request's cache may hold "
                f"{longest} tokens (sinks, window, eviction step and a step's "
                f"{config.max_num_batched_tokens} tokens), more positions than the model's "
                f"context of {model.max_position_embeddings}; lower the window or "
                f"--max-num-batched-tokens")
        return (KVCacheGroup(spec, tuple(range(model.num_hidden_layers))),)

    def _make_kv_connector(self, kv_ready: list[KVCacheReady]):
        """The scheduler side of the engine's KV connector (--kv-role, --kv-transfer-config),
        or None; the workers built theirs already and said what it needs to know."""
        config = self.config
        kv_config = config.transfer_config()
        if kv_config is None:
            return None
        from kvserve.kv_transfer.base import KVConnectorContext, KVConnectorRole
        from kvserve.kv_transfer.factory import make_connector

        connector = make_connector(kv_config, KVConnectorRole.SCHEDULER, KVConnectorContext(
            config.block_size, config.tensor_parallel_size, config.pipeline_parallel_size))
        if len(self.kv_manager.managers) > 1 and getattr(connector, "loads_are_cache_hits",
                                                         False):
            raise ValueError("the KV offload tiers keep one block table's blocks; this model's "
                             "KV layout has several (sliding-window layers): start it with "
                             "--disable-hybrid-kv-cache-manager to offload its KV")
        connector.set_handshake_metadata([ready.kv_connector_info for ready in kv_ready])
        return connector

    @property
    def runner(self):
        """The model runner of a `uni` executor (tests and profiling look inside it)."""
        return self.executor.runner

    # ---- sizing --------------------------------------------------------------------------
    def _num_kv_blocks(self, layers: int) -> int:
        """Blocks in the pool, each spanning `layers` layers' slots."""
        dtype = self.executor.kv_dtype
        per_block = layers * self.config.block_size * self.executor.kv_page_bytes
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        else:
            num_blocks = self.config.kv_cache_bytes() // per_block
        if num_blocks < 1:
            raise ValueError("KV cache budget is smaller than one block")
        if self.config.device == "cpu":  # the workers hold the weights already
            check_fits(num_blocks * per_block, "the KV cache",
                       {f"{num_blocks} blocks of {per_block:,} bytes": num_blocks * per_block},
                       "lower --kv-cache-memory-bytes or --num-kv-blocks")
        tokens = num_blocks * self.config.block_size
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)", num_blocks,
                    self.config.block_size, tokens, num_blocks * per_block / 2**20,
                    kv_dtype_name(dtype))
        return num_blocks

    def _max_model_len(self, num_blocks: int, groups: tuple[KVCacheGroup, ...]) -> int:
        spec = groups[0].spec
        if isinstance(spec, StreamingSpec):
            return self._streaming_max_len(num_blocks, spec)
        context = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or context
        if wanted > context:
            raise ValueError(f"max_model_len {wanted} exceeds the model's context {context}")
        chunk = self.config.max_num_batched_tokens if self.config.enable_chunked_prefill \
            else wanted
        capacity = pool_token_capacity(num_blocks, groups, chunk)
        if wanted > capacity:
            logger.warning("max_model_len lowered from %d to %d: the KV pool holds no more",
                           wanted, capacity)
            wanted = capacity
        return wanted

    def _streaming_max_len(self, num_blocks: int, spec: StreamingSpec) -> int:
        """With attention sinks the text has no length limit but --max-model-len's (the
        cache's is bounded); the pool must hold one request's bounded cache."""
        needed = spec.max_cached_tokens(self.config.max_num_batched_tokens) // spec.block_size
        if needed > num_blocks:
            raise ValueError(f"the KV pool ({num_blocks} blocks) cannot hold one streaming "
                             f"request's cache ({needed} blocks); give the cache more memory "
                             f"or lower --streaming-window")
        return self.config.max_model_len or 2**31 - 1

    def ready_info(self, pid: int) -> CoreReady:
        return CoreReady(
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            num_kv_blocks=self.num_kv_blocks, block_size=self.config.block_size,
            dtype=str(self.executor.dtype).removeprefix("torch."),
            kv_cache_dtype=kv_dtype_name(self.executor.kv_dtype),
            quantization=self.executor.quantization, load_seconds=self.load_seconds, pid=pid)

    def warm_up(self) -> None:
        """One tiny request through every stage (first-call costs: kernel selection, allocator),
        then forget its cached blocks."""
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        self.add_request(EngineCoreRequest(WARMUP_REQUEST_ID, [1, 2, 3, 4], params, 2))
        while self.has_unfinished():
            self.step()
        self.kv_manager.reset_prefix_cache()

    def _make_drafter(self, spec: SpeculativeConfig) -> Drafter:
        """Speculative decoding's judge of what drafting pays (the proposer itself runs in the
        worker that samples: spec_decode/proposers.py), with structured output's forced spans
        for constrained requests."""
        return Drafter(spec, grammar=GrammarDrafts(
            self._grammar_compiler(), lambda: load_tokenizer(resolve_model(self.config.model)),
            spec.num_speculative_tokens))

    def _drafter_layers(self, spec: SpeculativeConfig | None) -> int:
        """KV layers the proposer keeps in the pool's blocks beside the model's: MTP's
        modules (each attends over its own KV at the target's positions)."""
        if spec is None or spec.method != "mtp":
            return 0
        return mtp_module_count(self.model_config.num_nextn_predict_layers,
                                spec.num_speculative_tokens)

    def _profile_step_costs(self) -> None:
        """Speculative decoding's step-cost curve of this machine: steps of 1 to 64 tokens,
        three times each, timed like every step after (which keep it current). Each token of
        a profiled step is a one-token prompt of its own, so every token gets logits and is
        sampled, as in a decode batch or a verification of drafts. A step of one n-token prompt
        computes one row of logits: on Zen 4 such steps took 16 ms at 16 tokens and 26 at 32,
        against 24 and 44 for these, and the cheaper curve let drafts cut s8's throughput (16
        requests at once) by 7%."""
        start = time.perf_counter()
        sizes = [size for size in (1, 2, 4, 8, 16, 32, 64) if size <= self.config.max_num_seqs]
        for round_ in range(3):
            for size in sizes:
                for index in range(size):  # tokens of their own: no prefix hits
                    self.add_request(EngineCoreRequest(
                        f"{WARMUP_REQUEST_ID}-{round_}-{size}-{index}", [3 + index + 64 * round_],
                        SamplingParams(max_tokens=1, ignore_eos=True), 1))
                while self.has_unfinished():
                    self.step()
        self._profile_read_seconds()
        self.kv_manager.reset_prefix_cache()
        logger.info("speculative decoding: step costs profiled in %.1fs: %s; attention %.2f us "
                    "a query and context token", time.perf_counter() - start,
                    {size: f"{seconds * 1e3:.1f} ms"
                     for size, seconds in self.drafter.cost.points().items()},
                    self.drafter.cost.read_seconds * 1e6)

    def _profile_read_seconds(self) -> None:
        """The step-cost curve's price of attention reads (cost.py), on steps shaped as
        verifications: requests each computing READ_PROFILE_QUERIES new tokens over a cached
        prefix of its own (their K/V come from memory, as most requests' do), over long
        prefixes against one-block ones, alternated round by round; per query and context
        token of the difference. A draft's query is what the price decides on: priced from
        decode steps (one query a sequence, its context streamed from memory) it read 2.9-4.9
        us with the float kernel (AVX2), where a sequence's further queries find its K/V in
        cache, and the agentic scenario got a tenth of its drafts. Unprofiled (0) without
        prefix caching or room for such prompts."""
        config, num, queries = self.config, READ_PROFILE_REQUESTS, READ_PROFILE_QUERIES
        lengths = {"long": READ_PROFILE_CONTEXT, "short": config.block_size}
        if (not config.enable_prefix_caching or num > config.max_num_seqs
                or num * queries > config.max_num_batched_tokens
                or lengths["long"] + queries > self.max_model_len):
            return
        vocab = self.model_config.vocab_size - 3
        prefixes = {name: [[3 + (index * length + i + 5 * num * length) % vocab
                            for i in range(length)] for index in range(num)]
                    for name, length in lengths.items()}
        self._profile_steps("prefixes", [p for group in prefixes.values() for p in group])
        samples: dict[str, list[tuple[int, float]]] = {"long": [], "short": []}
        for round_ in range(READ_PROFILE_ROUNDS):
            for name in ("long", "short") if round_ % 2 == 0 else ("short", "long"):
                prompts = [prefix + [3 + (round_ * num * queries + index * queries + j) % vocab
                                     for j in range(queries)]
                           for index, prefix in enumerate(prefixes[name])]
                samples[name] += [(reads, seconds) for tokens, reads, seconds
                                  in self._profile_steps(f"{name}-{round_}", prompts)
                                  if tokens == num * queries]
        long, short = samples["long"], samples["short"]
        if long and short:
            extra = statistics.median(s for _, s in long) - statistics.median(s for _, s in short)
            reads = statistics.median(r for r, _ in long) - statistics.median(r for r, _ in short)
            self.drafter.cost.read_seconds = max(0.0, extra / reads)

    def _profile_steps(self, name: str, prompts: list[list[int]]) -> list[tuple[int, int, float]]:
        """(tokens, attention reads, seconds) of the steps that run these prompts to one
        token each, without drafts and outside the curve."""
        for index, prompt in enumerate(prompts):
            self.add_request(EngineCoreRequest(
                f"{WARMUP_REQUEST_ID}-reads-{name}-{index}", prompt,
                SamplingParams(max_tokens=1, ignore_eos=True), 1))
        self._step_costs = []  # step() records (tokens, reads, seconds) here, not in the curve
        try:
            while self.has_unfinished():
                self.step()
        finally:
            steps, self._step_costs = self._step_costs, None
        return steps

    def _observe_step_cost(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """A step's time, its tokens and attention reads, for speculative decoding's curve."""
        reads = sum(attention_reads(item.num_new_tokens,
                                    item.start_position + item.num_new_tokens)
                    for item in scheduler_output.scheduled)
        if self._step_costs is not None:
            self._step_costs.append((scheduler_output.num_batched_tokens, reads, seconds))
        else:
            self.drafter.cost.observe(scheduler_output.num_batched_tokens, seconds, reads)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front-end validated. A duplicate id fails only the newcomer."""
        if self.scheduler.has_request(request.request_id):
            self._failed.append(EngineCoreOutput(
                request.request_id, finish_reason="error",
                error=f"request id {request.request_id!r} is already in the engine"))
            return
        spec = request.params.structured_outputs
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, request.params, request.max_tokens,
            request.priority, request.arrival_time or time.monotonic(),
            request.kv_transfer_params, request.cache_salt, request.session_id,
            request.lora_id, request.pooling_params),
            wait_for_grammar=spec is not None and self.grammar_gate.must_wait(
                request.request_id, spec))

    @property
    def grammar_gate(self) -> GrammarGate:
        """Where constrained requests wait for their grammar (compiled in this process's
        shared compiler: a worker in this process and the forced-span drafter find it
        there)."""
        if self._grammar_gate is None:
            self._grammar_gate = GrammarGate(self._grammar_compiler())
        return self._grammar_gate

    def _grammar_compiler(self):
        return shared_compiler(self.config.model, self.model_config.vocab_size,
                               lambda: load_tokenizer(resolve_model(self.config.model)))

    def _admit_grammars(self, wait_s: float = 0.0) -> None:
        """Requests whose grammar compiled join the queue; failed compiles fail theirs. With
        `wait_s`, first sleep until a compile ends (nothing else to run)."""
        gate = self._grammar_gate
        if gate is None or not len(gate):
            return
        gate.wait(wait_s)
        ready, failed = gate.poll()
        for request_id in ready:
            self.scheduler.grammar_ready(request_id)
        for request_id, error in failed:
            self.fail_request(request_id, "compiling its grammar", error)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish these requests wherever they are; their blocks are free at once."""
        request_ids = list(request_ids)
        if self._grammar_gate is not None:
            self._grammar_gate.discard(request_ids)
        self.scheduler.abort_requests(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._failed or self._batch_queue)

    def num_unfinished(self) -> int:
        return len(self.scheduler.request_ids())

    def add_lora(self, lora_id: int, path: str) -> bool:
        """Have every worker load an adapter (checked by the front-end) before the next step."""
        if not self.config.enable_lora:
            return False
        self.step_encoder.lora_loads.append(LoRALoad(lora_id, path))
        self._loras.add(lora_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Free an adapter's slot once no request runs it (the front-end sends it no new
        ones): requests already running finish on it."""
        if lora_id not in self._loras:
            return False
        self._loras.discard(lora_id)
        pending = self.step_encoder.lora_loads
        if any(load.lora_id == lora_id for load in pending):  # no worker has it yet
            pending[:] = [load for load in pending if load.lora_id != lora_id]
            return True
        self._lora_unloading.add(lora_id)
        self._release_unused_loras()
        return True

    def _release_unused_loras(self) -> None:
        if not self._lora_unloading:
            return
        in_use = {request.lora_id for request in self.scheduler.requests.values()}
        done = self._lora_unloading - in_use
        if done:
            self.step_encoder.lora_unloads.extend(sorted(done))
            self._lora_unloading -= done

    def reset_prefix_cache(self) -> bool:
        reset = self.kv_manager.reset_prefix_cache()
        self.kv_events.flush()  # AllBlocksCleared goes out now, not with the next step
        return reset

    def stats(self) -> SchedulerStats:
        scheduler, kv = self.scheduler, self.kv_manager
        return SchedulerStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            kv_usage=kv.usage, num_used_blocks=kv.pool.num_used_blocks,
            prefix_queries=kv.stats.queries, prefix_hits=kv.stats.hits,
            num_preemptions=scheduler.num_preemptions, session_queries=kv.stats.session_queries,
            session_hits=kv.stats.session_hits, num_pinned_blocks=kv.pool.num_pinned_blocks,
            max_num_seqs=self.config.max_num_seqs, **self._spec_stats(), **self._ledger_stats())

    def _ledger_stats(self) -> dict:
        if self.step_ledger is None:
            return {}
        totals, roof = self.step_ledger.totals, self.step_ledger.roof
        return {"step_count": totals.steps, "step_seconds": totals.seconds,
                "step_tokens": totals.tokens, "step_prefill_tokens": totals.prefill_tokens,
                "step_flops": totals.flops, "step_bytes": totals.bytes,
                "step_kv_bytes": totals.kv_bytes,
                "roof_memory_gbps": roof.memory_gbps,
                "roof_gemm_gflops": self.step_ledger.gemm_gflops}

    def _spec_stats(self) -> dict:
        if self.drafter is None:
            return {}
        stats = self.drafter.stats
        return {"spec_drafts": stats.num_drafts, "spec_draft_tokens": stats.num_draft_tokens,
                "spec_accepted_tokens": stats.num_accepted_tokens,
                "spec_accepted_per_position": list(stats.accepted_per_position),
                "spec_method": self.drafter.config.method}

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One iteration of continuous batching.

        Failure isolation: the forward and sampling are batched, so when they raise,
        `_execute_isolated` re-runs each scheduled request alone to find the culprit; only it
        fails (an output with finish_reason "error"). An exception in scheduling or bookkeeping
        is not attributable and propagates to the caller.
        """
        self._step_started = time.perf_counter()
        self.thread_governor.tick()
        self._take_kv_reports()
        self._admit_grammars()
        self._release_unused_loras()
        if self.executor.max_concurrent_batches > 1:
            return self._step_pipelined()
        scheduler_output = self.scheduler.schedule()
        self._allow_drafts(scheduler_output)
        started = time.perf_counter()
        runner_output = self._execute(scheduler_output)
        if self.drafter is not None and scheduler_output.scheduled:
            drafting = sum(seconds for _, seconds in runner_output.draft_forwards)
            self._observe_step_cost(scheduler_output,
                                    time.perf_counter() - started - drafting)
        if not scheduler_output.scheduled:  # nothing to run but loads or compiles: no busy loop
            if self.scheduler.loading:
                self._take_kv_reports(LOAD_WAIT_SECONDS)
            elif self.scheduler.compiling:
                self._admit_grammars(GRAMMAR_WAIT_SECONDS)
        return self._update(scheduler_output, runner_output)

    # ---- the KV connector ---------------------------------------------------------------------
    def _take_kv_reports(self, wait_s: float = 0.0, poll: bool = False) -> int:
        """Apply what the workers' connectors finished (a transfer once every rank reported
        it): loaded requests run, failed loads recompute or fail, held blocks no longer read
        are freed (how many requests' blocks)."""
        if self.scheduler.connector is None:
            return 0
        done = self.kv_reports.aggregate(self.executor.take_kv_reports(wait_s, poll))
        freed = 0 if done is None else self.scheduler.update_connector_output(done)
        self._fail_loads()
        return freed

    def _fail_loads(self) -> None:
        """Loads that failed: recomputed (the scheduler runs them from their prefix hit), or
        failed with the reason under --kv-transfer-config's load_failure_policy "fail"."""
        if not self.scheduler.load_failures:
            return
        failures, self.scheduler.load_failures = self.scheduler.load_failures, []
        for request_id, why in failures:
            logger.warning("KV load of %s failed: %s", request_id, why)
            if self.scheduler.connector.config.load_failure_policy == "fail":
                self.fail_request(request_id, "loading its KV", RuntimeError(why))

    def _send_connector_work(self) -> None:
        """Work the step's finished requests left the workers (e.g. held blocks to serve)
        goes out now, not with the next scheduled step (an idle engine has none)."""
        connector = self.scheduler.connector
        metadata = connector.build_connector_meta(SchedulerOutput())
        if metadata is not None:
            self.executor.submit(connector_step(metadata))

    def housekeeping(self) -> bool:
        """Between steps: take the connector's reports (held blocks pulled or expired are
        freed); an idle core asks the workers for them. True when blocks were freed (the
        front-end's gauges then need a stats message)."""
        if self.scheduler.connector is None:
            return False
        idle = not self.has_unfinished()
        return self._take_kv_reports(poll=idle and bool(self.scheduler.held)) > 0

    def idle_poll_seconds(self) -> float | None:
        """How long an idle core may sleep before `housekeeping` is due (None: until a
        message comes)."""
        return HOUSEKEEPING_SECONDS if self.scheduler.held else None

    def _step_pipelined(self) -> EngineCoreOutputs:
        """With pipeline stages: submit a new batch while fewer than one per stage are out,
        and collect the oldest once the pipe is full or nothing new can run (vLLM's batch
        queue). Collecting blocks only on the oldest batch, which the stages finish first.
        A worker failure is a WorkerDiedError that ends the core (no per-request isolation:
        see kvserve/executor/mp.py)."""
        queue = self._batch_queue
        if len(queue) < self.executor.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            self._allow_drafts(scheduler_output)
            if (scheduler_output.scheduled or scheduler_output.finished_ids
                    or scheduler_output.kv_connector_metadata is not None):
                # finished ids or connector work alone: worker cleanup, transfers
                self.executor.submit(self.step_encoder.encode(scheduler_output))
            if scheduler_output.scheduled:
                queue.append(scheduler_output)
                self.scheduler.mark_in_flight(scheduler_output)
                if len(queue) < self.executor.max_concurrent_batches:
                    return self._update(SchedulerOutput(), ModelRunnerOutput.empty())
        if not queue:  # nothing to run but loads or compiles: no busy loop
            if self.scheduler.loading:
                self._take_kv_reports(LOAD_WAIT_SECONDS, poll=True)
            elif self.scheduler.compiling:
                self._admit_grammars(GRAMMAR_WAIT_SECONDS)
            return self._update(SchedulerOutput(), ModelRunnerOutput.empty())
        scheduler_output = queue.popleft()
        runner_output = self.executor.collect()
        self.scheduler.mark_landed(scheduler_output)
        return self._update(scheduler_output, runner_output)

    def _update(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Advance the scheduler by a step's results; each sampling request's delta: the tokens
        it kept (a stop mid-list drops the rest) with their logprobs."""
        sampling = [item.request for item in scheduler_output.scheduled
                    if item.sample and not item.request.is_finished]
        num_before = [request.num_output_tokens for request in sampling]
        if self.step_ledger is not None:
            self.step_ledger.record(scheduler_output.scheduled,
                                    time.perf_counter() - self._step_started)
        if runner_output.prompt_logprobs:
            _keep_prompt_logprobs(scheduler_output, runner_output.prompt_logprobs)
        if self.drafter is not None:
            self._observe_drafts(scheduler_output, runner_output)
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.drafter is not None:
            self._propose_drafts(runner_output.draft_token_ids)
        outputs, self._failed = self._failed, []
        outputs += [_pooled(request) for request in finished if request.pooling_params]
        drafts = {item.request.request_id: item.num_draft_tokens
                  for item in scheduler_output.scheduled if item.num_draft_tokens}
        for request, before in zip(sampling, num_before):
            new_tokens = request.output_token_ids[before:]
            if new_tokens:
                logprobs = runner_output.logprobs.get(request.request_id)
                output = self._delta(request, new_tokens, before == 0,
                                     logprobs[:len(new_tokens)] if logprobs else None)
                drafted = drafts.get(request.request_id, 0)
                if drafted:
                    output.num_draft_tokens = drafted
                    output.num_accepted_tokens = drafted - runner_output.num_rejected_tokens.get(
                        request.request_id, 0)
                outputs.append(output)
        if self.scheduler.connector is not None:
            self._send_connector_work()
        self.kv_events.flush()
        stats = self.stats()
        stats.expert_counts = runner_output.expert_counts
        return EngineCoreOutputs(outputs, stats)

    # ---- speculative decoding -------------------------------------------------------------------
    def _observe_drafts(self, scheduler_output: SchedulerOutput,
                        runner_output: ModelRunnerOutput) -> None:
        """What each verification kept, for the acceptance estimates and counters; finished
        requests' proposer state is dropped."""
        drafter = self.drafter
        drafter.observe_forwards(runner_output.draft_forwards)
        for request_id in scheduler_output.finished_ids:
            drafter.finish(request_id)
        rejected = runner_output.num_rejected_tokens
        for item in scheduler_output.scheduled:
            if item.num_draft_tokens and item.request.request_id in runner_output.sampled_token_ids:
                drafter.observe(item.request.request_id, item.num_draft_tokens,
                                item.num_draft_tokens - rejected.get(item.request.request_id, 0))

    def _allow_drafts(self, scheduler_output: SchedulerOutput) -> None:
        """How many drafts the worker's proposer may make after this step for each request
        that samples in it, for a next step of about one token per running request plus the
        waiting prompts (the drafter's judgement; the drafts are cut to what pays once the
        step lands)."""
        if self.drafter is None or self._step_costs is not None:  # profiling: no drafts
            return
        sampling = [item.request for item in scheduler_output.scheduled if item.sample]
        if not sampling:
            return
        scheduler = self.scheduler
        base = len(scheduler.running) + sum(request.num_tokens for _, request
                                            in scheduler.waiting)
        reads = sum(attention_reads(1, request.num_tokens + 1) for request in scheduler.running)
        scheduler_output.draft_limits = self.drafter.limits(
            sampling, min(base, self.config.max_num_batched_tokens), reads)

    def _propose_drafts(self, proposals: dict[str, list[int]]) -> None:
        """Drafts for the next step of every running request in decode, from the worker's
        `proposals`, as many as pay for a batch of this size (the step's other tokens: one per
        running request plus what prefills may take of the budget)."""
        if self._step_costs is not None:  # profiling attention reads: steps without drafts
            return
        scheduler = self.scheduler
        decoding, base, reads = [], 0, 0
        for request in scheduler.running:
            pending = request.num_tokens - request.num_computed_tokens
            base += pending
            reads += attention_reads(pending, request.num_tokens)
            if pending == 1 and request.request_id not in scheduler.in_flight:
                decoding.append(request)
        base += sum(request.num_tokens for _, request in scheduler.waiting)
        base = min(base, self.config.max_num_batched_tokens)
        if decoding:
            self.drafter.propose(decoding, base, reads, proposals)

    @staticmethod
    def _delta(request: Request, new_tokens: list[int], first: bool,
               logprobs) -> EngineCoreOutput:
        output = EngineCoreOutput(request.request_id, new_tokens, logprobs,
                                  num_preemptions=request.num_preemptions)
        if first:
            if request.sampling_params.prompt_logprobs is not None:
                output.prompt_logprobs = request.prompt_logprobs
            output.num_cached_tokens = request.num_cached_tokens
            output.first_scheduled_time = request.times.first_scheduled
            output.num_transferred_tokens = request.num_transferred_tokens
        if request.is_finished:
            output.finish_reason = request.finish_reason()
            output.stop_reason = request.stop_reason
            output.kv_transfer_params = request.kv_handle
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.executor.execute(self.step_encoder.encode(scheduler_output))
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
        merged = ModelRunnerOutput.empty()
        for item in scheduler_output.scheduled:
            try:
                result = self.executor.execute(self.step_encoder.encode_alone(
                    item, scheduler_output.draft_limits.get(item.request.request_id, 0)))
            except Exception as exc:
                self.fail_request(item.request.request_id, "running it", exc)
                continue
            merged.merge(result)
        return merged

    def fail_request(self, request_id: str, stage: str, exc: BaseException) -> None:
        """Abort one request and report why (in the next outputs)."""
        logger.error("request %s failed while %s: %s: %s", request_id, stage,
                     type(exc).__name__, exc)
        self.abort_requests([request_id])
        self._failed.append(EngineCoreOutput(
            request_id, finish_reason="error",
            error=f"the engine failed while {stage}: {type(exc).__name__}: {exc}"))

    def fail_all(self, stage: str, exc: BaseException) -> EngineCoreOutputs:
        """After an exception no request owns: fail every request in the core."""
        for request_id in self.scheduler.request_ids():
            self.fail_request(request_id, stage, exc)
        outputs, self._failed = self._failed, []
        return EngineCoreOutputs(outputs, self.stats())

    def shutdown(self) -> None:
        self.kv_events.close()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        self.executor.shutdown()


def _keep_prompt_logprobs(scheduler_output: SchedulerOutput,
                          scored: dict[str, tuple[int, list]]) -> None:
    """Each request's prompt logprobs from this step, in place by position: a prefill computed
    again after a preemption overwrites its earlier entries rather than repeating them."""
    for item in scheduler_output.scheduled:
        entry = scored.get(item.request.request_id)
        if entry is not None:
            start, entries = entry
            del item.request.prompt_logprobs[start:]
            item.request.prompt_logprobs.extend(entries)


def _pooled(request: Request) -> EngineCoreOutput:
    """A pooling request's only output: its vector, finished, with a first output's fields."""
    if request.pooling_output is None:  # the workers' fault, never the request's
        return EngineCoreOutput(request.request_id, finish_reason="error",
                                error="the workers returned no pooled vector for it")
    return EngineCoreOutput(request.request_id, finish_reason="stop",
                            num_cached_tokens=request.num_cached_tokens,
                            first_scheduled_time=request.times.first_scheduled,
                            num_preemptions=request.num_preemptions,
                            pooling_output=request.pooling_output)
