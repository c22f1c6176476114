"""The built-in logits processors: logit_bias, min_tokens, the penalties (repetition, frequency,
presence), the thinking budget (sample/thinking_budget.py) and min_p. The sampler runs them in
that order, then any custom ones; each keeps only the rows whose requests set it, so the others
cost nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sample.logits_processor import AddedRow, LogitsProcessor, PerRowProcessor
from kvserve.sample.thinking_budget import ThinkingBudgetProcessor


def builtin_processors() -> list[LogitsProcessor]:
    return [LogitBiasProcessor(), MinTokensProcessor(), PenaltiesProcessor(),
            ThinkingBudgetProcessor(), MinPProcessor()]


class _TokenSetProcessor(PerRowProcessor):
    """Per row a set of token ids (and values for them): applied to the whole batch with one
    indexed write, from index tensors rebuilt only when the rows change."""

    def __init__(self) -> None:
        super().__init__()
        self._index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def is_argmax_invariant(self) -> bool:
        return False

    def rows_changed(self) -> None:
        self._index = None

    def token_values(self, state) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's (token ids, values)."""
        return state

    def batched_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row of each entry, token id, value) over every row that uses the processor."""
        if self._index is None:
            pairs = [(row, *self.token_values(state)) for row, state in self.rows.items()]
            rows = torch.cat([torch.full_like(ids, row) for row, ids, _ in pairs])
            self._index = (rows, torch.cat([ids for _, ids, _ in pairs]),
                           torch.cat([values for _, _, values in pairs]))
        return self._index


class LogitBiasProcessor(_TokenSetProcessor):
    """Adds a request's logit_bias to its row."""

    def row_state(self, row: AddedRow):
        bias = row.params.logit_bias
        if not bias:
            return None
        return torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, ids, values = self.batched_index()
        return logits.index_put_((rows, ids), values, accumulate=True)


class MinTokensProcessor(_TokenSetProcessor):
    """Masks a request's stop tokens (EOS and stop_token_ids) until it has min_tokens outputs."""

    def row_state(self, row: AddedRow):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens or not params.all_stop_token_ids:
            return None
        return (params.min_tokens, row.output_token_ids,
                torch.tensor(sorted(params.all_stop_token_ids), dtype=torch.long))

    def token_values(self, state) -> tuple[torch.Tensor, torch.Tensor]:
        stop_ids = state[2]
        return stop_ids, torch.full(stop_ids.shape, float("-inf"))

    def update_state(self, batch_update) -> None:
        super().update_state(batch_update)
        # the output lists grow by themselves: rows that reached min_tokens leave
        done = [row for row, (minimum, output, _) in self.rows.items() if len(output) >= minimum]
        for row in done:
            del self.rows[row]
        if done:
            self.rows_changed()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, ids, values = self.batched_index()
        return logits.index_put_((rows, ids), values)


@dataclass(eq=False)
class _Penalties:
    repetition: float
    frequency: float
    presence: float
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the request's own, growing list
    counts: torch.Tensor | None = None  # of each output token, kept up to date incrementally
    counted: int = 0
    in_prompt: torch.Tensor | None = None

    def output_counts(self, vocab: int) -> torch.Tensor:
        output = self.output_token_ids
        if self.counts is None or len(output) < self.counted:
            self.counts, self.counted = torch.zeros(vocab), 0
        if len(output) > self.counted:
            new = output[self.counted:]
            self.counts.scatter_add_(0, torch.tensor(new), torch.ones(len(new)))
            self.counted = len(output)
        return self.counts

    def prompt_mask(self, vocab: int) -> torch.Tensor:
        if self.in_prompt is None:
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool)
            if self.prompt_token_ids:
                self.in_prompt[torch.tensor(self.prompt_token_ids)] = True
        return self.in_prompt


class PenaltiesProcessor(PerRowProcessor):
    """vLLM's repetition penalty (divides positive logits of tokens seen in the prompt or the
    output, multiplies negative ones), then frequency (x count in the output) and presence
    (once per token in the output) subtracted."""

    def is_argmax_invariant(self) -> bool:
        return False

    def row_state(self, row: AddedRow):
        params = row.params
        if not params.needs_penalties:
            return None
        return _Penalties(params.repetition_penalty, params.frequency_penalty,
                          params.presence_penalty, row.prompt_token_ids, row.output_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        for i, state in self.rows.items():
            counts = state.output_counts(vocab)
            if state.repetition != 1.0:
                seen = (counts > 0) | state.prompt_mask(vocab)
                row_logits = logits[i]
                penalty = state.repetition
                scaled = torch.where(row_logits > 0, row_logits / penalty, row_logits * penalty)
                logits[i] = torch.where(seen, scaled, row_logits)
            logits[i] -= state.frequency * counts
            logits[i] -= state.presence * (counts > 0).float()
        return logits


class MinPProcessor(PerRowProcessor):
    """Drops the tokens less likely than min_p times the row's likeliest one. Argmax-invariant:
    it runs on random rows after temperature, top-k and top-p (the sampler's order)."""

    def __init__(self) -> None:
        super().__init__()
        self._batched: tuple[torch.Tensor, torch.Tensor] | None = None

    def is_argmax_invariant(self) -> bool:
        return True

    def row_state(self, row: AddedRow):
        params = row.params
        return params.min_p if params.min_p > 0 and not params.greedy else None

    def rows_changed(self) -> None:
        self._batched = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._batched is None:
            rows = sorted(self.rows)
            self._batched = (torch.tensor(rows),
                             torch.tensor([self.rows[row] for row in rows]).unsqueeze(1))
        rows, min_p = self._batched
        whole = len(rows) == logits.shape[0]
        selected = logits if whole else logits[rows]
        probs = torch.softmax(selected, dim=-1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        selected = selected.masked_fill(probs < threshold, float("-inf"))
        return selected if whole else logits.index_put_((rows,), selected)
