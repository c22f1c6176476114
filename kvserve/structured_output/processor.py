"""The grammar's mask, applied on the sampling worker as a logits processor: each constrained
row keeps an xgrammar matcher that follows the row's output tokens, and before every choice
the row's logits outside what the grammar allows next are set to -inf. Rows without a grammar
cost nothing. Under speculative decoding the sampler verifies depth by depth, appending each
emitted token to the row's output first, so the mask at every depth is the grammar's after
the tokens before it, and a draft the grammar forbids can never be accepted."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvserve.kernels import reference
from kvserve.sample.logits_processor import AddedRow, PerRowProcessor
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class _RowGrammar:
    matcher: Any
    output: list[int]  # the request's own output list (it grows as the request samples)
    consumed: int = 0  # tokens the matcher has accepted
    failed: bool = field(default=False)

    def follow(self, row: int) -> None:
        """Feed the matcher what the row emitted since the last step."""
        while self.consumed < len(self.output) and not self.failed:
            if self.matcher.is_terminated():  # what follows (ignore_eos) is not its business
                self.consumed = len(self.output)
                return
            token = self.output[self.consumed]
            if not self.matcher.accept_token(token):
                self.failed = True
                logger.warning("batch row %d: token %d is outside its grammar; the row's "
                               "output is no longer constrained", row, token)
            self.consumed += 1


class GrammarProcessor(PerRowProcessor):
    def __init__(self, compiler: GrammarCompiler, apply_token_bitmask_: Callable | None = None):
        """`compiler`: the process's (`shared_compiler`): in the engine core's process the
        core's gate compiled each request's grammar before the request could run.
        `apply_token_bitmask_`: the runner's kernel op (csrc/sampling.cpp; xgrammar's own CPU
        one measured ~275 us a row at 49k tokens), torch's reference when None."""
        super().__init__()
        self.vocab_size = compiler.vocab_size
        self._apply = apply_token_bitmask_ or reference.apply_token_bitmask_
        self.compiler = compiler
        self._bitmask: torch.Tensor | None = None
        self._rows_sorted: list[int] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def prefetch(self, params: SamplingParams) -> None:
        """Start compiling a new request's grammar as the request arrives, so that a worker
        in a process of its own (tensor or pipeline parallel) compiles it beside the
        prefill; in the core's process it is already compiled."""
        if params.structured_outputs is not None:
            self.compiler.submit(params.structured_outputs)

    def row_state(self, row: AddedRow) -> _RowGrammar | None:
        spec = row.params.structured_outputs
        if spec is None:
            return None
        try:
            grammar = self.compiler.submit(spec).result()
        except Exception:  # the core's gate compiled the same spec: not expected
            logger.exception("a grammar that compiled in the front-end failed on the worker; "
                             "the request's output is not constrained")
            return None
        stop = sorted(row.params.all_stop_token_ids) or None
        matcher = self.compiler.matcher(grammar, stop)
        return _RowGrammar(matcher, row.output_token_ids)

    def rows_changed(self) -> None:
        self._rows_sorted = sorted(self.rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = self._rows_sorted
        bitmask = self._bitmask_rows(len(rows))
        masked = []
        for slot, row in enumerate(rows):
            state = self.rows[row]
            state.follow(row)
            if state.failed or state.matcher.is_terminated():
                continue
            state.matcher.fill_next_token_bitmask(bitmask, slot)
            masked.append(slot)
        if masked:
            self._apply(logits, bitmask, torch.tensor([rows[slot] for slot in masked]),
                        torch.tensor(masked))
        return logits

    # ---- inside -----------------------------------------------------------------------------
    def _bitmask_rows(self, count: int) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < count:
            self._bitmask = torch.empty(max(count, 8), words, dtype=torch.int32)
        return self._bitmask
