"""The registry of model families: architecture name -> its model class (a CausalLM subclass),
or the "module:Class" that holds it, imported the first time a model of that family is built.

Names are enough to check an architecture, so the API front-end (which only checks) never
imports torch or the model code; the engine core, which builds the model, imports the one
family it runs. The built-in families are a table of names in `kvserve.models.families`;
families from other packages register through the `kvserve.model_families` entry point group
(each entry point a callable run once, which calls `register_model`), or by calling
`register_model` directly (e.g. from a `KVSERVE_PLUGINS` plugin, which runs in every process of
an engine).
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points

from kvserve.config import FamilyRules, architecture_of_hf_model_type, register_family_rules
from kvserve.errors import UnsupportedArchitectureError
from kvserve.plugins import PluginError

ENTRY_POINT_GROUP = "kvserve.model_families"
_models: dict[str, type | str] = {}
_lock = threading.Lock()
_discovered = False


def register_model(architecture: str, model_class: type | str,
                   config_rules: FamilyRules | None = None) -> None:
    """`architecture`: the name configs and GGUF files give (HF model_type as we name it,
    GGUF general.architecture). `model_class`: the class, or "package.module:ClassName" to
    import it only when a model of the family is built (as vLLM's registry). `config_rules`:
    how the family's configs are read (kvserve.config.FamilyRules, torch-free; None: the
    shared reading, as a Llama-shaped config)."""
    if isinstance(model_class, str) and ":" not in model_class:
        raise ValueError(f"register_model({architecture!r}, {model_class!r}): a lazy class is "
                         f"named 'package.module:ClassName'")
    if config_rules is not None:
        if config_rules.architecture != architecture:
            raise ValueError(f"register_model({architecture!r}): its config rules are "
                             f"{config_rules.architecture!r}'s")
        register_family_rules(config_rules)
    _models[architecture] = model_class


def model_class_for(architecture: str) -> type:
    """The family's class (its module imported now if it was registered by name)."""
    check_architecture(architecture)
    entry = _models[architecture]
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise PluginError(f"model family {architecture!r}: {entry} cannot be imported: "
                              f"{type(exc).__name__}: {exc}") from exc
        _models[architecture] = entry
    return entry


def check_architecture(architecture: str | None, where: str | None = None) -> None:
    """UnsupportedArchitectureError naming every registered family unless one is
    `architecture` (what a config or GGUF file at `where` names: an HF model_type is read as
    the family whose rules claim it, e.g. gemma3_text as gemma3)."""
    _discover()
    if architecture_of_hf_model_type(architecture) not in _models:
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
