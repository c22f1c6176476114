"""Response bodies of the pooling routes, in OpenAI's and vLLM's shapes: vectors as JSON floats or
base64 (little-endian float32 bytes, what OpenAI's client decodes), and `usage` counting the
prompt tokens (nothing is generated)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np

from kvserve.outputs import PoolingRequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def encode_vector(output: PoolingRequestOutput, encoding_format: str) -> list[float] | str:
    values = output.outputs.values
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return list(values)


def usage(outputs: list[PoolingRequestOutput]) -> dict[str, Any]:
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0, "prompt_tokens_details": None}


def vectors_response(kind: str, model: str, outputs: list[PoolingRequestOutput],
                     encoding_format: str) -> dict[str, Any]:
    """/v1/embeddings' (`kind` "embedding") or /pooling's ("pooling") body."""
    field = "embedding" if kind == "embedding" else "data"
    return {"id": new_id("embd" if kind == "embedding" else "pool"), "object": "list",
            "created": int(time.time()), "model": model,
            "data": [{"index": index, "object": kind,
                      field: encode_vector(output, encoding_format)}
                     for index, output in enumerate(outputs)],
            "usage": usage(outputs)}


def score_response(model: str, scores: list[float],
                   outputs: list[PoolingRequestOutput]) -> dict[str, Any]:
    return {"id": new_id("score"), "object": "list", "created": int(time.time()),
            "model": model,
            "data": [{"index": index, "object": "score", "score": score}
                     for index, score in enumerate(scores)],
            "usage": usage(outputs)}


def rerank_response(model: str, documents: list[str], scores: list[float], top_n: int,
                    return_documents: bool, outputs: list[PoolingRequestOutput]
                    ) -> dict[str, Any]:
    """The documents by relevance, best first (ties in the order given), the best `top_n`
    (0: all)."""
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    if top_n:
        order = order[:top_n]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    tokens = usage(outputs)
    return {"id": new_id("rerank"), "model": model,
            "usage": {"prompt_tokens": tokens["prompt_tokens"],
                      "total_tokens": tokens["total_tokens"]},
            "results": results}
