"""PoolingParams: what a pooling request asks of the model instead of sampled tokens (vLLM's
class and field names): its prompt's final hidden states pooled into one vector, optionally cut
to its first `dimensions` (Matryoshka) and L2-normalized.

The user sets `dimensions`, `normalize` and `task`; the front-end fills the rest from the
model's pooler config (`verify`, as vLLM's), so the core and the workers read everything they
need from the request itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

from kvserve.errors import InvalidRequestError

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS")
POOLING_TASKS: tuple[str, ...] = ("embed", "encode", "score")


@dataclass
class PoolingParams:
    # Matryoshka: keep the first this many dimensions (then normalize, if it does)
    dimensions: int | None = None
    # L2-normalize the vector (None: the model's pooler config says)
    normalize: bool | None = None
    task: str | None = None  # embed | encode | score (vLLM's pooling tasks; all pool alike)
    # filled by `verify` from the model's pooler config: how the prompt's hidden states pool,
    # and whether cached prefix blocks must be computed again (every position is pooled)
    pooling_type: str | None = None
    skip_reading_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError("dimensions must be a positive integer",
                                      param="dimensions")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}",
                                      param="task")

    def verify(self, pooling_type: str, normalize: bool, hidden_size: int,
               matryoshka_dimensions: list[int] | None = None) -> None:
        """Fill what the model decides (the pooling, normalization by default) and check the
        request against it: `dimensions` at most the hidden size, and one of the model's
        Matryoshka dimensions where its config lists them."""
        self.pooling_type = pooling_type
        self.skip_reading_prefix_cache = pooling_type != "LAST"
        if self.normalize is None:
            self.normalize = normalize
        dims = self.dimensions
        if dims is None:
            return
        if dims > hidden_size:
            raise InvalidRequestError(f"dimensions {dims} exceeds the model's hidden size "
                                      f"{hidden_size}", param="dimensions")
        if matryoshka_dimensions and dims not in matryoshka_dimensions:
            raise InvalidRequestError(
                f"dimensions {dims} is not one this model was trained for (its Matryoshka "
                f"dimensions: {', '.join(map(str, matryoshka_dimensions))})",
                param="dimensions")

    def clone(self) -> "PoolingParams":
        return copy.deepcopy(self)
