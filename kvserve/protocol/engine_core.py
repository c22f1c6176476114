"""The messages between the front-end and the engine core, as msgspec structs.

The same structs serve the in-process core (passed as objects) and the core process (msgpack
over ZeroMQ: the fastest and smallest codec measured, benchmarks/ipc_codec.py). A request
crosses once; after that only deltas do: the new token ids of the requests that advanced, and
finish events. `array_like` drops field names from the wire; `omit_defaults` drops the fields
a delta does not use.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.protocol.kv_transfer_params import KVTransferParams
from kvserve.pooling_params import PoolingParams
from kvserve.protocol.worker import TokenLogprobs
from kvserve.sampling_params import SamplingParams

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


# ---- front-end -> core ---------------------------------------------------------------------
class EngineCoreRequest(msgspec.Struct, tag=True, **_WIRE):
    """One single-sample request (n > 1 is fanned out by the front-end). Stop strings stay in
    the front-end; `params` still carries them, unused here."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    priority: int = 0
    arrival_time: float = 0.0
    # disaggregated prefill/decode: keep the KV for a decode engine, or where to pull it from
    kv_transfer_params: KVTransferParams | None = None
    cache_salt: str | None = None  # prefix blocks are shared only within one salt
    session_id: str | None = None  # its blocks are kept for the session's next turn
    lora_id: int = 0  # the LoRA adapter it runs (0: the base model)
    # a pooling request (--runner pooling): its prompt's hidden states pooled, no tokens
    # sampled; `params` then only carries defaults the core reads
    pooling_params: PoolingParams | None = None


class AbortRequests(msgspec.Struct, tag=True, **_WIRE):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True, **_WIRE):
    """A call of one of EngineCore.UTILITIES, answered by a UtilityResult with the same id."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True, **_WIRE):
    pass


CoreInput = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown


# ---- core -> front-end ---------------------------------------------------------------------
class EngineCoreOutput(msgspec.Struct, **_WIRE):
    """What one request did in one step: the token(s) it sampled, and how it ended if it did.
    finish_reason "error" carries the message of an exception that belonged to this request."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = -1  # prefix-cache hit tokens, on the first output
    first_scheduled_time: float | None = None  # on the first output
    num_preemptions: int = 0
    error: str | None = None
    num_transferred_tokens: int = 0  # prompt tokens whose KV was pulled, on the first output
    kv_transfer_params: KVTransferParams | None = None  # the handle, on a held request's last
    # speculative decoding: drafts verified in this step, and how many were accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # on the first output of a request that asked (SamplingParams.prompt_logprobs): prompt
    # tokens 1.. each scored from the position before it (token 0 has no logprob)
    prompt_logprobs: list[TokenLogprobs] | None = None
    # a pooling request's vector (PoolingParams: truncated, normalized), on its only output
    pooling_output: list[float] | None = None


class SchedulerStats(msgspec.Struct, **_WIRE):
    """The gauges and counters /metrics shows, after the step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_used_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    spec_drafts: int = 0  # speculative decoding: verification steps that carried drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    spec_method: str = ""
    # agent sessions: prompt tokens of requests naming a session, and how many were cached
    session_queries: int = 0
    session_hits: int = 0
    num_pinned_blocks: int = 0  # free blocks kept for recent sessions
    # mixtures of experts, on the steps that collected them (about once a second): per MoE
    # layer, the tokens routed to each expert since the model was loaded
    expert_counts: dict[int, list[int]] = {}
    # the step ledger's totals since the core started (kvserve.core.step_ledger) and this
    # machine's roof, for the bottleneck doctor (kvserve.bottleneck); a zero roof: no ledger
    step_count: int = 0
    step_seconds: float = 0.0
    step_tokens: int = 0
    step_prefill_tokens: int = 0
    step_flops: float = 0.0
    step_bytes: float = 0.0
    step_kv_bytes: float = 0.0
    roof_memory_gbps: float = 0.0
    roof_gemm_gflops: float = 0.0
    max_num_seqs: int = 0  # the scheduler's cap: waiting behind a full batch is queueing


class EngineCoreOutputs(msgspec.Struct, tag=True, **_WIRE):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None


class UtilityResult(msgspec.Struct, tag=True, **_WIRE):
    call_id: int
    result: Any = None
    error: str | None = None


class CoreReady(msgspec.Struct, tag=True, **_WIRE):
    """The core's handshake: what the front-end needs to validate requests, and the sizing."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    kv_cache_dtype: str
    quantization: str
    load_seconds: float
    pid: int


class CoreFailed(msgspec.Struct, tag=True, **_WIRE):
    """The core could not start (bad model file, bad option): the message says why."""

    message: str


class CoreDying(msgspec.Struct, tag=True, **_WIRE):
    """After start: the core hit an error it cannot go on from (a worker died) and exits once
    it has stopped its workers, which takes seconds; the front-end fails its requests now."""

    message: str


CoreOutput = EngineCoreOutputs | UtilityResult | CoreReady | CoreFailed | CoreDying


class Codec:
    """msgpack encoders/decoders for both directions (one of each per process: they keep
    buffers)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.input_decoder = msgspec.msgpack.Decoder(CoreInput)
        self.output_decoder = msgspec.msgpack.Decoder(CoreOutput)

    def encode(self, message) -> bytes:
        return self.encoder.encode(message)

    def decode_input(self, data) -> CoreInput:
        return self.input_decoder.decode(data)

    def decode_output(self, data) -> CoreOutput:
        return self.output_decoder.decode(data)
