"""Models: tensors in, tensors out, over one flattened ragged batch. No requests, no scheduling.
A registry of families (registry.py), each composed of the shared layers (layers/).

The loader's names are imported on first use (PEP 562), so that the registry can be read
without importing torch (the API front-end checks architectures by name)."""

from kvserve.models.registry import register_model

_FROM_LOADER = ("build_model", "load_config", "load_model", "random_model", "resolve_dtype",
                "resolve_kv_dtype")

__all__ = [*_FROM_LOADER, "register_model"]


def __getattr__(name: str):
    if name in _FROM_LOADER:
        from kvserve.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
