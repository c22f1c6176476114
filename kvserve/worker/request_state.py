"""What a worker holds of each request between steps: the one request type the model runner
reads (a new per-request field for the worker is added here and in `NewRequestData`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.protocol.worker import NewRequestData
from kvserve.sample.pooler import PromptPooler
from kvserve.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    """A request's id, sampling parameters, the token ids penalties look at and its block
    table. The output rank appends the tokens it samples."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # KV cache group 0's table
    group_block_ids: list[list[int]] = field(default_factory=list)  # groups 1.. (hybrid layout)
    # attention sinks: the evicted tokens the window's cached keys are rotated for (their
    # positions are within the cache: evicted tokens dropped)
    kv_shift: int = 0
    # prompt then output: one list that grows (speculative proposers index it in place)
    all_token_ids: list[int] = field(default_factory=list)
    lora_id: int = 0  # its LoRA adapter (0: the base model)
    # a pooling request's pooler: what its prompt's chunks have pooled so far
    pooler: PromptPooler | None = None

    @classmethod
    def from_new(cls, new: NewRequestData) -> "CachedRequestState":
        return cls(new.request_id, new.prompt_token_ids, new.params,
                   all_token_ids=list(new.prompt_token_ids), lora_id=new.lora_id,
                   pooler=PromptPooler(new.pooling_params) if new.pooling_params else None)


@dataclass
class ScheduledItem:
    """One request's part of a step, as the runner takes it."""

    request: CachedRequestState
    token_ids: list[int]
    start_position: int
    sample: bool
    num_draft_tokens: int = 0  # the last this many of token_ids are drafts to verify

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_ids(self) -> list[int]:
        return self.request.block_ids

    @property
    def tables(self) -> list[list[int]]:
        """Its block table in every KV cache group."""
        return [self.request.block_ids, *self.request.group_block_ids]


@dataclass
class RunnerInput:
    """A step for the model runner: the scheduled requests, and those finished since the last
    step (their per-request state, e.g. seeded generators, is dropped)."""

    scheduled: list[ScheduledItem]
    finished_ids: list[str]
