"""A request as the scheduler sees it: token ids, how many have KV computed, and its status.

No tensors and no text here. `num_computed_tokens` is the single notion of progress: prefill
chunks, prefix-cache hits and decode steps all just move it towards `num_tokens`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.pooling_params import PoolingParams
from kvserve.protocol.block_hash import salted_root
from kvserve.protocol.worker import TokenLogprobs
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # its prompt's KV is being pulled
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its structured output's grammar compiles
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    kv_transfer_params: Any = None  # the KVTransferParams its request carried, if any
    cache_salt: str | None = None  # prefix blocks are shared only with the same salt
    session_id: str | None = None  # an agent session's: its blocks outlive it for a while
    lora_id: int = 0  # its LoRA adapter (0: the base); its cache salt keeps adapters apart
    pooling_params: PoolingParams | None = None  # a pooling request's: no tokens are sampled

    def __post_init__(self) -> None:
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled lazily
        self.hash_root = salted_root(self.cache_salt)  # the first block's parent hash
        self.times = RequestTimes(arrival=self.arrival_time)
        self.kv_load_attempted = False  # its remote KV was asked for (once: a retry recomputes)
        self.num_external_tokens = 0  # tokens a KV connector is loading for it (asynchronously)
        self.num_transferred_tokens = 0  # prompt tokens whose KV came from another engine
        self.kv_handle: Any = None  # the KVTransferParams its last output hands a decode engine
        # speculative decoding: draft tokens to verify in its next step (set by the drafter
        # after each step; they compete for the token budget like any token)
        self.spec_token_ids: list[int] = []
        # prompt logprobs as its prefill computes them, chunk by chunk (position p scores
        # prompt token p + 1); sent with its first output
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.pooling_output: list[float] | None = None  # a pooling request's, once pooled

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs are scored from every prompt position's logits, which a cached or
        loaded block never had computed here: such a request computes its whole prompt (its
        blocks are still cached for others). So does a pooling request whose pooling reads
        every position (MEAN, CLS): LAST reads only the last, which is always computed."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is not None or (
            pooling is not None and pooling.skip_reading_prefix_cache)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
