"""Scores for an embedding model, as vLLM computes them: pairs of texts (one against many, or
two equal lists pairwise) each scored by the cosine similarity of their embeddings. Shared by
`LLM.score` and the server's /score and /rerank."""

from __future__ import annotations

import math
from typing import Sequence, TypeVar

from kvserve.errors import InvalidRequestError

T = TypeVar("T")


def score_pairs(data_1: T | Sequence[T], data_2: T | Sequence[T], single: type | tuple
                ) -> list[tuple[T, T]]:
    """vLLM's pairing: one item against one, one against each of a list, or two lists of
    equal length pairwise (`single`: the type(s) one item has, e.g. str)."""
    firsts = [data_1] if isinstance(data_1, single) else list(data_1)
    seconds = [data_2] if isinstance(data_2, single) else list(data_2)
    if not firsts or not seconds:
        raise InvalidRequestError("both sides of a score need at least one input",
                                  param="text_1" if not firsts else "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidRequestError(f"text_1 has {len(firsts)} inputs and text_2 "
                                  f"{len(seconds)}: give one text_1, or as many as text_2",
                                  param="text_2")
    return list(zip(firsts, seconds))


def cosine(first: Sequence[float], second: Sequence[float]) -> float:
    """The cosine similarity of two embeddings, in plain Python (the API server's front-end
    never imports torch; an embedding has thousands of values at most)."""
    norms = math.sqrt(math.fsum(a * a for a in first)) * math.sqrt(
        math.fsum(b * b for b in second))
    return math.fsum(a * b for a, b in zip(first, second)) / max(norms, 1e-12)
