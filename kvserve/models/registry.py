"""The registry of model families: architecture name -> its model class (a CausalLM subclass).

The built-in families register themselves when `kvserve.models.families` is imported; families
from other packages register through the `kvserve.model_families` entry point group (each entry
point a callable run once, which calls `register_model`), or by calling `register_model`
directly (e.g. from a `KVSERVE_PLUGINS` plugin, which runs in every process of an engine).
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points

from kvserve.errors import UnsupportedArchitectureError
from kvserve.plugins import PluginError

ENTRY_POINT_GROUP = "kvserve.model_families"
_models: dict[str, type] = {}
_lock = threading.Lock()
_discovered = False


def register_model(architecture: str, model_class: type) -> None:
    """`architecture`: the name configs and GGUF files give (HF model_type as we name it,
    GGUF general.architecture)."""
    _models[architecture] = model_class


def model_class_for(architecture: str) -> type:
    check_architecture(architecture)
    return _models[architecture]


def check_architecture(architecture: str | None, where: str | None = None) -> None:
    """UnsupportedArchitectureError naming every registered family unless one is
    `architecture` (what a config or GGUF file at `where` names)."""
    _discover()
    if architecture not in _models:
        source = f" ({where})" if where else ""
        raise UnsupportedArchitectureError(
            f"Architecture {architecture!r} is not supported yet{source}; kvserve implements "
            f"{', '.join(sorted(_models))} (Gemma 3 as its text model, gemma3_text).")


def registered_architectures() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(_models))


def rediscover() -> None:
    """Look for entry points again on the next lookup (after a package was installed, or its
    directory put on sys.path)."""
    global _discovered
    with _lock:
        _discovered = False


def _discover() -> None:
    """The built-in families, then every installed entry point (once per process). A plugin
    that fails to load is a clear error, never a silent skip (as KVSERVE_PLUGINS's)."""
    global _discovered
    with _lock:
        if _discovered:
            return
        importlib.import_module("kvserve.models.families")
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            try:
                entry.load()()
            except Exception as exc:
                raise PluginError(f"model family plugin {entry.name!r} ({entry.value}, entry "
                                  f"point group {ENTRY_POINT_GROUP}) failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
        _discovered = True
