"""Models: tensors in, tensors out, over one flattened ragged batch. No requests, no scheduling."""

from kvserve.models.loader import (
    build_empty_model,
    load_model,
    random_model,
    resolve_dtype,
    resolve_kv_dtype,
)

__all__ = ["build_empty_model", "load_model", "random_model", "resolve_dtype",
           "resolve_kv_dtype"]
