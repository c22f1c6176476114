"""Models: tensors in, tensors out, over one flattened ragged batch. No requests, no scheduling.
A registry of families (registry.py), each composed of the shared layers (layers/)."""

from kvserve.models.loader import (
    build_model,
    load_config,
    load_model,
    random_model,
    resolve_dtype,
    resolve_kv_dtype,
)
from kvserve.models.registry import register_model

__all__ = ["build_model", "load_config", "load_model", "random_model", "register_model", "resolve_dtype",
           "resolve_kv_dtype"]
