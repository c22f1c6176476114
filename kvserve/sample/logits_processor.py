"""Logits processors: the one interface for whatever edits a batch's logits before a token is
chosen (logit_bias, min_tokens, the penalties and min_p are built in; custom ones come from
`--logits-processors` / `LLM(logits_processors=...)`), in the shape of vLLM v1's.

A processor is built once per worker and keeps batch-level state: the worker's persistent batch
gives each sampling request a row it keeps while it samples step after step, and each step tells
every processor what changed (a BatchUpdate) before `apply` edits the whole [rows, vocab] logits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

if TYPE_CHECKING:
    import torch

from kvserve.sample.processor_names import qualified_name, resolve
from kvserve.sampling_params import SamplingParams


class MoveDirection(Enum):
    UNIDIRECTIONAL = auto()  # the request at `source` now has row `target`; `source` is empty
    SWAP = auto()  # the requests at `source` and `target` trade rows


class AddedRow(NamedTuple):
    index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    # the request's own list: it grows as the request samples, so a processor that keeps it
    # sees every token without further events
    output_token_ids: list[int]


class MovedRow(NamedTuple):
    source: int
    target: int
    direction: MoveDirection


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the persistent batch since the last step. Apply in this order: removed,
    added, moved; an added or moved row may take the index of a removed one."""

    batch_size: int  # rows after the update
    removed: Sequence[int] = ()
    added: Sequence[AddedRow] = ()
    moved: Sequence[MovedRow] = ()

    @property
    def empty(self) -> bool:
        return not (self.removed or self.added or self.moved)


# Where the sampler holds the logits it hands to processors: it samples on the CPU whatever
# device the model runs on (one copy of the sampled rows a step), so a processor keeps its
# tensors here. Built on first use (module __getattr__) so that the API front-end, which only
# checks processor names, never imports torch.
def __getattr__(name: str) -> Any:
    if name == "SAMPLING_DEVICE":
        import torch

        return torch.device("cpu")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class ProcessorInit:
    """What a processor is built with, once per worker. `device`: where the logits it edits
    live (SAMPLING_DEVICE), which is not the model's device when the model runs on a GPU."""

    vocab_size: int
    max_num_seqs: int
    device: torch.device


class LogitsProcessor(ABC):
    """Edits the logits of the rows whose requests use it; leaves the other rows alone."""

    def __init__(self, init: ProcessorInit | None = None) -> None:
        """Custom processors are built with a ProcessorInit (the built-ins need none)."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Check a request's arguments (usually `params.extra_args`) in the front-end, before it
        reaches the engine: raise ValueError and the request is refused (a 400 on the server)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor can never change a greedy choice (it only removes tokens that
        are not the best, as min_p does): then it runs only for rows that sample randomly,
        after temperature and top-k/top-p, and greedy rows skip it."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called every step before `apply`; None when the batch did not change."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole batch's logits, [rows, vocab] float32, row i = batch row i; may write in
        place (the sampler hands over a tensor it owns) and returns the result."""

    def is_active(self) -> bool:
        """False when no row of the batch uses the processor: the sampler skips `apply`."""
        return True


class PerRowProcessor(LogitsProcessor):
    """A processor whose state is one entry per row that uses it, kept in `self.rows` (row index
    -> entry) through the batch's events. Subclasses say what an entry is (`row_state`) and
    apply over `self.rows`; rows that do not use the processor never get an entry."""

    def __init__(self, init: ProcessorInit | None = None) -> None:
        super().__init__(init)
        self.rows: dict[int, Any] = {}

    @abstractmethod
    def row_state(self, row: AddedRow) -> Any | None:
        """A new row's entry, or None when its request does not use this processor."""

    def rows_changed(self) -> None:
        """Called after `self.rows` changed (e.g. to rebuild batched index tensors)."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None and apply_batch_update(self.rows, batch_update,
                                                           self.row_state):
            self.rows_changed()

    def is_active(self) -> bool:
        return bool(self.rows)


_ABSENT = object()


def apply_batch_update(states: dict[int, Any], batch_update: BatchUpdate,
                       new_state) -> bool:
    """Updates a row -> state dict by the batch's events (`new_state(AddedRow)` -> state or
    None); True when it changed."""
    changed = False
    for index in batch_update.removed:
        changed |= states.pop(index, _ABSENT) is not _ABSENT
    for row in batch_update.added:
        state = new_state(row)
        if state is None:
            changed |= states.pop(row.index, _ABSENT) is not _ABSENT
        else:
            states[row.index] = state
            changed = True
    for source, target, direction in batch_update.moved:
        moving, other = states.pop(source, _ABSENT), states.pop(target, _ABSENT)
        if moving is not _ABSENT:
            states[target] = moving
        if direction is MoveDirection.SWAP and other is not _ABSENT:
            states[source] = other
        changed |= moving is not _ABSENT or other is not _ABSENT
    return changed


# ---- custom processors by name ---------------------------------------------------------------

def load_processor_classes(names: Sequence[str]) -> list[type[LogitsProcessor]]:
    """The classes behind `module:Class` names; a clear ValueError for one that cannot be
    imported or is not a LogitsProcessor."""
    classes = []
    for name in names:
        qualified = qualified_name(name)
        try:
            cls = resolve(qualified)
        except Exception as exc:
            raise ValueError(f"logits processor {name!r} cannot be imported: "
                             f"{type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits processor {name!r} is not a subclass of "
                             f"kvserve.sample.logits_processor.LogitsProcessor")
        classes.append(cls)
    return classes
