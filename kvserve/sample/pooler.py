"""Pooling a prompt's final hidden states (after the model's last norm, before the LM head) into
one vector, chunk by chunk as chunked prefill computes them: the LAST token's, the MEAN over
every prompt position, or the CLS (first) token's; then Matryoshka truncation and L2
normalization as the request's PoolingParams ask (truncate first, so the kept dimensions are a
unit vector again).

MEAN keeps one float32 partial sum per chunk, keyed by the chunk's first position: a chunk run
again (a batch re-run request by request after it raised) replaces its own sum rather than
adding to it, and a prompt computed again from position 0 (after a preemption) starts over.
"""

from __future__ import annotations

import torch

from kvserve.pooling_params import PoolingParams


class PromptPooler:
    """One pooling request's pooler, held by the worker beside the request's state."""

    def __init__(self, params: PoolingParams):
        self.params = params
        self.kind = params.pooling_type or "LAST"
        self._partial_sums: dict[int, tuple[torch.Tensor, int]] = {}  # MEAN: start -> (sum, n)
        self._row: torch.Tensor | None = None  # LAST: the latest chunk's last row; CLS: row 0

    def add_chunk(self, start_position: int, rows: torch.Tensor) -> None:
        """The hidden states [n, H] of prompt positions start_position.. computed this step."""
        if start_position == 0:
            self._partial_sums.clear()
        if self.kind == "MEAN":
            self._partial_sums[start_position] = (rows.float().sum(dim=0), rows.shape[0])
        elif self.kind == "LAST":
            self._row = rows[-1].float()
        elif start_position == 0:  # CLS
            self._row = rows[0].float()

    def result(self) -> list[float]:
        """The pooled vector once the prompt's last chunk is in, truncated and normalized as
        asked."""
        if self.kind == "MEAN":
            total = sum(partial for partial, _ in self._partial_sums.values())
            vector = total / sum(count for _, count in self._partial_sums.values())
        else:
            vector = self._row
        if vector is None or not isinstance(vector, torch.Tensor):
            raise RuntimeError(f"{self.kind} pooling saw no hidden states of the prompt")
        return finish_vector(vector, self.params.dimensions, bool(self.params.normalize))


def finish_vector(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> list[float]:
    """Matryoshka truncation to `dimensions`, then L2 normalization (eps as torch's
    F.normalize), as a list of floats."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
