"""What the engine returns, shaped like vLLM's RequestOutput so users can switch by import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # speculative decoding: draft tokens verified for this sample, and how many were accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # its own entry and the best alternatives (vLLM's shape)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)
    num_transferred_tokens: int = 0  # prompt tokens whose KV a prefill engine computed
    kv_transfer_params: Any = None  # from a prefill engine: where a decode engine pulls the KV


# ---- pooling (--runner pooling), vLLM's classes -------------------------------------------
@dataclass
class PoolingOutput:
    """The pooled (truncated, normalized) vector: `values` as floats, `data` as vLLM's float32
    tensor, made when first read (the API server's front-end reads `values` and never imports
    torch)."""

    values: list[float]

    @property
    def data(self):
        import torch

        return torch.tensor(self.values, dtype=torch.float32)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any  # PoolingOutput; EmbeddingOutput or ScoringOutput in the subclasses
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """LLM.embed's: `outputs.embedding`, a list of floats."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(list(output.outputs.values)),
                   output.prompt_token_ids, output.num_cached_tokens, output.finished,
                   output.metrics)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """LLM.score's: `outputs.score`, one pair's similarity."""
