"""EngineConfig: every engine option in one frozen dataclass. The CLI builds its flags from the
fields' metadata (help text), so an option added here appears everywhere."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.model_source import DEFAULT_MODEL
from kvserve.options import json_option_text
from kvserve.options import option as _opt

DEFAULT_KV_CACHE_BYTES = 1 << 30
# The step's token budget when --max-num-batched-tokens is not given. On CPU a step of 2048
# prompt tokens runs for seconds at 1B and up (~3.4 s, Llama-3.2-1B Q4_K_M on Zen 5), and the
# requests decoding beside it advance one token per step: with 512, 16 streams of 512/128
# (s14) went 93 -> 99 tokens/s and their median TTFT 7.6 -> 2.7 s, SmolLM2's s2 TTFT 1.2 ->
# 0.5 s at the same throughput (-1%, within the noise); 256 was no better than 512
# (docs/performance.md). Elsewhere vLLM's online default.
DEFAULT_STEP_TOKENS = {"cpu": 512}
DEFAULT_STEP_TOKENS_ELSEWHERE = 2048


def default_step_tokens(device: str) -> int:
    return DEFAULT_STEP_TOKENS.get(device.split(":")[0], DEFAULT_STEP_TOKENS_ELSEWHERE)


@dataclass(frozen=True)
class EngineConfig:
    model: str = _opt(DEFAULT_MODEL, "bundled short name, .gguf file or HF model directory")
    dtype: str = _opt("auto", "weights/activations dtype: auto (bfloat16 where the CPU has "
                      "native bf16, else float32), float32, bfloat16, float16",
                      choices=["auto", "float32", "bfloat16", "float16"])
    device: str = _opt("cpu", "torch device to run on")
    max_model_len: int | None = _opt(None, "max tokens per sequence (prompt + output); default: "
                                     "the model's context, capped by the KV pool")
    block_size: int = _opt(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _opt(None, "exact number of KV blocks (overrides "
                                     "--kv-cache-memory-bytes)")
    kv_cache_memory_bytes: int | None = _opt(None, "bytes for the KV cache (default 1 GiB)")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = _opt(
        False, "vLLM's flag: a model that mixes full-attention and sliding-window layers "
        "(Gemma 2/3) keeps all KV of every layer in one group (the kernels still mask the "
        "windows) instead of a block table per group holding only each window's blocks")
    streaming_window: int | None = _opt(
        None, "attention sinks (StreamingLLM), for every request: keep the first "
        "--streaming-sink-tokens tokens and at least this many recent ones, so a sequence of "
        "any length runs in bounded KV memory (positions are counted within the cache; "
        "max_model_len is then the text's limit, unbounded by default). Default: off")
    streaming_sink_tokens: int = _opt(4, "with --streaming-window: the leading tokens every "
                                      "query keeps seeing, kept in whole KV blocks (rounded "
                                      "up to the block size); 0 is plain window attention")
    max_num_seqs: int = _opt(256, "max sequences in one batch")
    max_num_batched_tokens: int | None = _opt(
        None, "token budget of one engine step (default: 512 on CPU, 2048 on other devices; "
        "without chunked prefill at least max_model_len)")
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps")
    max_num_partial_prefills: int | None = _opt(
        None, "prompts prefilled in one step at most (default: as many as the token budget "
        "holds); 1 serves a burst of short prompts one after another, so each waits only for "
        "those ahead of it")
    scheduling_policy: str = _opt("fcfs", "fcfs or priority (lower value runs first)",
                                  choices=["fcfs", "priority"])
    attention_backend: str = _opt("paged", "attention implementation: paged (fused layer ops, "
                                  "reads KV blocks in place), sdpa_batched (eager, batched "
                                  "decode) or torch_ref (the plain reference)",
                                  choices=["paged", "sdpa_batched", "torch_ref"])
    kv_cache_dtype: str = _opt("auto", "K/V storage: auto (bfloat16 beside float32 activations "
                               "when float32 is only the machine's default, else the "
                               "activations' dtype), float32, bfloat16 (bf16 with float32 "
                               "activations: K/V rounded to bf16), int8 (per token and head "
                               "symmetric int8 with a float32 scale: 68 bytes a row of 64 "
                               "against bf16's 128) or fp8 (= fp8_e4m3, vLLM's names: e4m3 "
                               "codes, scale absmax / 448, the same 68 bytes); perplexity in "
                               "docs/performance-journal.md",
                               choices=["auto", "float32", "bfloat16", "int8", "fp8",
                                        "fp8_e4m3"])
    quantization: str = _opt("auto", "weights of the decoder projections: auto (for a GGUF "
                             "in bfloat16, or in float32 where the machine has no native "
                             "bf16: gguf; else none), gguf (the file's own block types, "
                             "Q4_0-Q8_0 and Q4_K-Q6_K, at their own bits per weight; decode "
                             "activations rounded to int8 per group of 32 for integer dot "
                             "products, as llama.cpp; other block types as w4a8), none, int4 "
                             "(groupwise, exact for Q4_1 GGUFs), int8 (groups of 32 as Q8_0 "
                             "where the compiled kernels run, per channel elsewhere), w8a8 "
                             "(int8 weights, int8 activations for batches; +4%% perplexity on "
                             "SmolLM2), w4a8 (int4 weights, int8 activations as gguf's) or "
                             "fp8 (e4m3 with a scale per 128x128 block, as DeepSeek-V3's "
                             "checkpoints; run as Q8_0; auto for such a checkpoint)",
                             choices=["auto", "none", "gguf", "int4", "int8", "w8a8", "w4a8",
                                      "fp8"])
    cpu_kernels: bool = _opt(True, "use the compiled C++ CPU kernels for the paged backend "
                             "(--no-cpu-kernels runs their torch-op versions)")
    autotune: bool = _opt(True, "time the low-bit kernels against the dense GEMM per shape, in "
                          "the background while the engine is idle (cached on disk per machine), "
                          "and use each where it wins; --no-autotune uses fixed row limits")
    num_threads: int | None = _opt(None, "torch intra-op threads for the engine's kernels "
                                   "(default: one per core)")
    enforce_eager: bool = _opt(False, "run the decoder layers of decode steps from Python "
                               "op by op; by default the fused path runs them as one C++ call "
                               "(the CPU's counterpart of CUDA graphs; same tokens either way)")
    adaptive_threads: bool = _opt(True, "while other processes keep some of our cores busy, "
                                  "run the kernels on the cores left (checked once a second); "
                                  "--no-adaptive-threads keeps the thread count fixed")
    step_ledger: bool = _opt(True, "count each step's tokens, FLOPs, bytes and time against "
                             "this machine's roof (measured once, ~1 s, then cached) for the "
                             "bottleneck doctor (/doctor, kvserve:bottleneck_regime, kvserve "
                             "doctor); --no-step-ledger skips the measure and the counting")
    seed: int = _opt(0, "seed for requests that sample without their own seed")
    enable_lora: bool = _opt(False, "serve LoRA adapters (PEFT directories) on the base model: "
                             "requests name one, and requests for different adapters and the "
                             "base share steps")
    max_loras: int = _opt(1, "LoRA adapters loaded at once (each holds a slot in every "
                          "projection; on the CPU there is no separate device cache)")
    max_lora_rank: int = _opt(16, "the largest LoRA rank an adapter may have (slots are "
                              "sized for it)")
    tensor_parallel_size: int = _opt(1, "tensor-parallel ranks (worker processes, each with a "
                                     "slice of every layer and of the KV heads)",
                                     aliases=["-tp"])
    pipeline_parallel_size: int = _opt(1, "pipeline stages (worker processes, each with a "
                                       "contiguous range of the layers; one batch in flight "
                                       "per stage)",
                                       aliases=["-pp"])
    enable_expert_parallel: bool = _opt(
        False, "mixture-of-experts layers split by expert over the tensor-parallel ranks "
        "(attention still by heads): each rank holds whole experts and runs the tokens routed "
        "to them; the ranks' outputs are summed by the layer's one all-reduce")
    enable_eplb: bool = _opt(
        False, "expert-parallel load balancing: every --eplb-config step_interval steps, "
        "copies of the experts are re-placed over the ranks from the tokens each took "
        "(needs --enable-expert-parallel; outputs do not change)")
    eplb_config: str | None = _opt(
        None, "vLLM's --eplb-config JSON: {\"step_interval\": 3000, "
        "\"num_redundant_experts\": 0, \"window_size\": (= step_interval), "
        "\"log_balancedness\": false}")
    distributed_executor_backend: str | None = _opt(
        None, "where the model runs: uni (in the engine core's process), mp (one worker "
        "process per rank on this host) or ray (one Ray actor per rank, on the cluster "
        "RAY_ADDRESS names or a local Ray instance; needs kvserve[ray]); default: uni for one "
        "rank, else mp", choices=["uni", "mp", "ray"])
    engine_core: str = _opt("process", "where the engine core (scheduler, KV manager, model) "
                            "runs: process (its own process, over ZeroMQ: a crash there cannot "
                            "take the front-end down, and the front-end's Python never holds "
                            "the core's GIL; measured as fast or faster, docs/architecture.md) or "
                            "thread (a thread of the front-end process)",
                            choices=["process", "thread"])
    kv_role: str | None = _opt(
        None, "disaggregated prefill/decode: prefill (compute prompts, keep their KV for a "
        "decode engine to pull), decode (pull a prompt's KV from the prefill engine named in "
        "the request's kv_transfer_params) or both", choices=["prefill", "decode", "both"])
    kv_transfer_config: str | None = _opt(
        None, "vLLM's --kv-transfer-config JSON: kv_connector (TcpConnector, the default, or "
        "module:Class; kv_connector_module_path), kv_role (kv_producer, kv_consumer, "
        "kv_both), kv_ip and kv_port (where this engine serves its held KV, rank r on kv_port "
        "+ r; default 127.0.0.1 and free ports), kv_connector_extra_config {hold_timeout_s, "
        "transfer_timeout_s, load_failure_policy: recompute | fail, transport: tcp | shm, and "
        "a connector's own keys}")
    kv_offload_ram_bytes: int | None = _opt(
        None, "KV offload tier in host memory: blocks the prefix cache evicts are kept here "
        "(least recently used out first) and loaded back instead of recomputed")
    kv_offload_disk_dir: str | None = _opt(
        None, "KV offload tier on disk, in this folder: evicted blocks as checksummed files, "
        "reused after a restart of the same model and settings")
    kv_offload_disk_bytes: int | None = _opt(
        None, "the disk tier's size limit (default 16 GiB)")
    kv_offloading_size: float | None = _opt(
        None, "vLLM's flag: the host-memory offload tier in GiB (--kv-offload-ram-bytes)")
    kv_offloading_backend: str = _opt("native", "vLLM's flag; native, the built-in tiers",
                                      choices=["native"])
    kv_offload_load_policy: str = _opt(
        "measured", "when a prefix a tier holds is loaded back: measured (only when this "
        "engine's own step, prefill and load timings say loading beats recomputing it: a "
        "busy engine loads, an idle one with a slow tier recomputes short runs) or always",
        choices=["measured", "always"])
    kv_session_ttl: float = _opt(
        300.0, "agent sessions: seconds a request's KV blocks are kept after it ends when it "
        "names a session (session_id, prompt_cache_key or user), evicted only when nothing "
        "else is left; 0: sessions are kept like any prefix")
    kv_session_max_fraction: float = _opt(
        0.5, "the share of the KV pool that sessions' kept blocks may hold")
    kv_events_config: str | None = _opt(
        None, "vLLM's --kv-events-config JSON: publish which KV blocks this engine caches and "
        "evicts, for `kvserve router --policy kv-aware`, e.g. {\"enable_kv_cache_events\": "
        "true, \"endpoint\": \"tcp://127.0.0.1:5557\", \"replay_endpoint\": "
        "\"tcp://127.0.0.1:5558\"}; keys: enable_kv_cache_events, publisher (zmq | null), "
        "endpoint, replay_endpoint (replay, snapshots), topic, buffer_steps, hwm, "
        "max_queue_size, heartbeat_seconds. `kvserve serve` publishes on free loopback ports "
        "when this is not given (/kv_events_info names them); '{\"enable_kv_cache_events\": "
        "false}' turns that off")
    speculative_config: str | None = _opt(
        None, "vLLM's --speculative-config JSON (LLM(speculative_config={...}) takes a dict): "
        "{\"method\": \"ngram\", \"num_speculative_tokens\": k, \"prompt_lookup_min\": a, "
        "\"prompt_lookup_max\": b}; drafts are verified exactly (greedy tokens unchanged, "
        "sampling distributions preserved), and each step carries only as many as this "
        "machine's measured step costs and the running acceptance say pay")
    logits_processors: tuple[str, ...] = _opt(
        (), "custom logits processors, as 'module:Class' (vLLM's flag; repeat it or separate "
        "names by commas): each worker builds one of each, and each decides from a request's "
        "extra_args (vllm_xargs over HTTP) whether it applies to it", multiple=True)
    runner: str = _opt(
        "auto", "vLLM's flag: generate (sampled tokens: completions, chat) or pooling (each "
        "prompt's final hidden states pooled into one vector: /v1/embeddings, /pooling, "
        "/score, /rerank, LLM.embed); auto is generate", choices=["auto", "generate", "pooling"])
    pooler_config: str | None = _opt(
        None, "with --runner pooling, vLLM's pooler config JSON over the checkpoint's own "
        "(sentence-transformers' modules.json, else LAST + normalize): {\"pooling_type\": "
        "\"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true, \"dimensions\": n}",
        aliases=["--override-pooler-config"])

    def __post_init__(self) -> None:
        from kvserve.sample.processor_names import qualified_name

        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", default_step_tokens(self.device))
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")

        # classes (LLM(logits_processors=[...])) become names: the config crosses processes
        processors = self.logits_processors
        if isinstance(processors, str):
            processors = [name for name in processors.split(",") if name.strip()]
        object.__setattr__(self, "logits_processors",
                           tuple(qualified_name(p) for p in processors))
        from kvserve.spec_decode.config import speculative_config_text

        object.__setattr__(self, "speculative_config",
                           speculative_config_text(self.speculative_config))
        from kvserve.eplb_config import eplb_config_text

        object.__setattr__(self, "eplb_config", eplb_config_text(self.eplb_config))
        from kvserve.config.pooler import parse_pooler_override

        object.__setattr__(self, "pooler_config",
                           json_option_text(self.pooler_config, parse_pooler_override))
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("--enable-eplb needs --enable-expert-parallel")
        if self.eplb().num_redundant_experts and not self.enable_eplb:
            raise ValueError("eplb_config's num_redundant_experts needs --enable-eplb")
        from kvserve.quant import check_quantization_device

        check_quantization_device(self.quantization, self.device)
        kv_choices = type(self).__dataclass_fields__["kv_cache_dtype"].metadata["choices"]
        if self.kv_cache_dtype not in kv_choices:  # here, not in a worker process at load
            raise ValueError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose one of "
                             f"{', '.join(kv_choices)}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        self._check_zmq_binds(self.transfer_config())  # a bad one fails here
        if self.streaming_window is not None and (self.streaming_window < 1
                                                  or self.streaming_sink_tokens < 0):
            raise ValueError("--streaming-window must be >= 1 and --streaming-sink-tokens "
                             ">= 0")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"the uni executor runs one rank; {self.world_size} ranks need "
                             f"--distributed-executor-backend mp (this host) or ray")

    def _check_zmq_binds(self, transfer) -> None:
        """Parse --kv-events-config, and refuse (ZmqSecurityError) a KV sender or KV events
        socket bound beyond loopback without KVSERVE_ZMQ_SECRET, here rather than in a worker."""
        from kvserve.kv_events import parse_kv_events_config
        from kvserve.zmq_security import curve_keys

        keys = curve_keys()  # a secret too short fails here too
        events = parse_kv_events_config(self.kv_events_config)
        for config in (transfer, events):
            if config is not None:
                config.check_binds(keys)

    def eplb(self):
        """The parsed --eplb-config (kvserve/eplb_config.py)."""
        from kvserve.eplb_config import parse_eplb_config

        return parse_eplb_config(self.eplb_config)

    def transfer_config(self):
        """The engine's KV connector settings (kv_transfer/config.py), offload tiers
        included, or None without a connector."""
        from kvserve.kv_transfer.config import kv_transfer_config

        return kv_transfer_config(self.kv_role, self.kv_transfer_config, self._offload())

    def _offload(self) -> dict | None:
        ram = self.kv_offload_ram_bytes
        if ram is None and self.kv_offloading_size is not None:
            ram = int(self.kv_offloading_size * 2**30)
        if not ram and not self.kv_offload_disk_dir:
            return None
        # the disk tier's folder is named by it: another model or KV format never reads it
        identity = "|".join(str(v) for v in (self.model, self.dtype, self.quantization,
                                            self.kv_cache_dtype, self.streaming_window))
        return {"ram_bytes": ram or 0, "disk_dir": self.kv_offload_disk_dir,
                "disk_bytes": self.kv_offload_disk_bytes, "fingerprint": identity,
                "load_policy": self.kv_offload_load_policy}

    @property
    def streaming_sink_blocks(self) -> int | None:
        """With attention sinks on, the blocks the sinks take (tokens rounded up to blocks);
        None when off. The core's policy (StreamingSpec) and the workers both read it."""
        if self.streaming_window is None:
            return None
        return -(-self.streaming_sink_tokens // self.block_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    def kv_cache_bytes(self) -> int:
        return self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
