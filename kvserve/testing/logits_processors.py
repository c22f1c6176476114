"""Custom logits processors for the test suites, and small examples of the interface
(kvserve/sample/logits_processor.py). Load one with
`--logits-processors kvserve.testing.logits_processors:BanTokens` or
`LLM(logits_processors=[BanTokens])`; a request asks for it through its extra_args
(`vllm_xargs` over HTTP)."""

from __future__ import annotations

import torch

from kvserve.sample.logits_processor import AddedRow, PerRowProcessor, ProcessorInit
from kvserve.sampling_params import SamplingParams


def _check_token_ids(params: SamplingParams, key: str) -> None:
    """extra_args[key], where given, must be a list of token ids."""
    ids = (params.extra_args or {}).get(key)
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ValueError(f"{key} must be a list of token ids")


class BanTokens(PerRowProcessor):
    """Never lets a request draw the token ids in its extra_args["ban_tokens"]."""

    def __init__(self, init: ProcessorInit):
        super().__init__(init)
        self.vocab_size = init.vocab_size

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        _check_token_ids(params, "ban_tokens")

    def is_argmax_invariant(self) -> bool:
        return False

    def row_state(self, row: AddedRow) -> torch.Tensor | None:
        banned = [t for t in (row.params.extra_args or {}).get("ban_tokens") or ()
                  if t < self.vocab_size]
        return torch.tensor(banned, dtype=torch.long) if banned else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, banned in self.rows.items():
            logits[row, banned] = float("-inf")
        return logits


class FailWhenAsked(PerRowProcessor):
    """Raises in `apply` while a row whose extra_args has "fail": true is in the batch."""

    def is_argmax_invariant(self) -> bool:
        return False

    def row_state(self, row: AddedRow) -> bool | None:
        return True if (row.params.extra_args or {}).get("fail") else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("FailWhenAsked: a request asked this processor to fail")


class RecordRows(PerRowProcessor):
    """Follows every row through the events: `tags()` is the extra_args["tag"] of each row's
    request (None when it has none) as this processor believes the batch to be, for tests to
    compare with the worker's persistent batch. Also checks each batch's size."""

    def __init__(self, init: ProcessorInit):
        super().__init__(init)
        self.batch_size = 0
        self.size_mismatches: list[tuple[int, int]] = []  # (batch size, logits rows)

    def is_argmax_invariant(self) -> bool:
        return False

    def row_state(self, row: AddedRow) -> tuple[str | None]:
        return ((row.params.extra_args or {}).get("tag"),)  # an entry for every row

    def update_state(self, batch_update) -> None:
        super().update_state(batch_update)
        if batch_update is not None:
            self.batch_size = batch_update.batch_size

    def tags(self) -> list[str | None]:
        return [self.rows[row][0] for row in range(self.batch_size)]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] != self.batch_size or set(self.rows) != set(range(self.batch_size)):
            self.size_mismatches.append((self.batch_size, logits.shape[0]))
        return logits


class ForceTokens(PerRowProcessor):
    """Makes a request write exactly the token ids in its extra_args["force_tokens"] (then
    anything): the model still runs every step, but this row's k-th token is the list's k-th.
    For end-to-end tests of what reads a model's reply (tool calls, reasoning channels) on
    random-weight models."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        _check_token_ids(params, "force_tokens")

    def is_argmax_invariant(self) -> bool:
        return False

    def row_state(self, row: AddedRow) -> tuple[list[int], list[int]] | None:
        forced = (row.params.extra_args or {}).get("force_tokens")
        return (forced, row.output_token_ids) if forced else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (forced, written) in self.rows.items():
            if len(written) < len(forced) and forced[len(written)] < logits.shape[1]:
                token = forced[len(written)]
                logits[row] = float("-inf")
                logits[row, token] = 0.0
        return logits
