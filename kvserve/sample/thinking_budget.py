"""The thinking budget (vLLM's `thinking_token_budget`, llama.cpp's `--reasoning-budget`): once
a request has thought for its budget of tokens, the tokens that close the thinking are forced
one a step, so the answer follows instead of the thinking running to max_tokens.

A built-in logits processor, one entry per request that sets a budget. Its state is read off
the request's own output list (which grows by itself), from the start after a preemption, so
it needs no events of its own and never drifts from what the request wrote. Thinking opens
where the prompt left it (`ThinkingMarkers.starts_inside`) or where the output writes the
start marker; it closes where the output writes the end marker (the model's own close, or the
forced one), and only the first thinking is counted, as reasoning models think once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvserve.sample.logits_processor import AddedRow, PerRowProcessor


# thinking opens only at the reply's start: its start marker within this many tokens of it
# beyond the marker's own (leading whitespace), as the reasoning parsers read it
OPENING_SLACK = 4


class _State(NamedTuple):
    inside: bool = False
    thought: int = 0  # tokens of thinking so far
    over: bool = False  # closed, or never opened: nothing more to do


@dataclass(eq=False)
class _Thinking:
    budget: int
    start: list[int]
    end: list[int]
    output: list[int]  # the request's own, growing list
    starts_inside: bool
    # the state after each output token read; a speculative step appends its drafts' tokens
    # to the output and takes them off again, so the state steps back with the list
    states: list[_State] = field(default_factory=list)

    @property
    def state(self) -> _State:
        return self.states[-1] if self.states else _State(inside=self.starts_inside)

    def advance(self) -> None:
        """Read the tokens written since the last call."""
        output = self.output
        del self.states[len(output):]
        while len(self.states) < len(output) and not self.state.over:
            self.states.append(self._next(self.state, len(self.states) + 1))

    def _next(self, state: _State, written: int) -> _State:
        """The state once the output's first `written` tokens are read."""
        if not state.inside:
            opened = _ends_at(self.output, written, self.start)
            return _State(inside=opened,
                          over=not opened and written >= len(self.start) + OPENING_SLACK)
        if _ends_at(self.output, written, self.end):
            return state._replace(over=True)
        return state._replace(thought=state.thought + 1)

    def forced_token(self) -> int | None:
        """The token this row must write now, if its budget is spent."""
        state = self.state
        if not state.inside or state.over or state.thought < self.budget:
            return None
        # the close goes on from what the output ends with: the forced tokens so far, or the
        # beginning of a close the model wrote itself
        return self.end[_partial_close(self.output, self.end)]


def _ends_at(tokens: list[int], end: int, marker: list[int]) -> bool:
    """Whether tokens[:end] ends with the marker."""
    return bool(marker) and end >= len(marker) and tokens[end - len(marker):end] == marker


def _partial_close(tokens: list[int], marker: list[int]) -> int:
    """How many of the marker's first tokens the output ends with (short of all of them)."""
    for length in range(min(len(marker) - 1, len(tokens)), 0, -1):
        if tokens[-length:] == marker[:length]:
            return length
    return 0


class ThinkingBudgetProcessor(PerRowProcessor):
    """Forces the end of thinking for the rows whose budget is spent; leaves the rest alone."""

    def is_argmax_invariant(self) -> bool:
        return False

    def row_state(self, row: AddedRow) -> _Thinking | None:
        params = row.params
        markers = params.thinking
        if params.thinking_token_budget is None or markers is None or not markers.end_token_ids:
            return None
        return _Thinking(params.thinking_token_budget, list(markers.start_token_ids),
                         list(markers.end_token_ids), row.output_token_ids,
                         markers.starts_inside)

    def update_state(self, batch_update) -> None:
        super().update_state(batch_update)
        closed = []  # rows whose thinking closed (or never opened)
        for row, state in self.rows.items():
            state.advance()
            if state.state.over:
                closed.append(row)
        for row in closed:  # its thinking is over: it costs nothing more
            del self.rows[row]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, state in self.rows.items():
            state.advance()  # a speculative step's depths append tokens between calls
            token = state.forced_token()
            if token is not None and token < logits.shape[1]:
                logits[row] = float("-inf")
                logits[row, token] = 0.0
        return logits
