"""Custom logits processors by name (`module:Class`): the form EngineConfig stores and sends to
the engine core and worker processes, each of which imports the class itself. No torch here:
EngineConfig is built in light processes too."""

from __future__ import annotations

import importlib
from typing import Any


def qualified_name(processor: str | type) -> str:
    """`module:Class` for a processor class, or for a name given as `module:Class` or
    `module.Class`; a class must be importable by that name (the workers import it)."""
    if isinstance(processor, str):
        separator = ":" if ":" in processor else "."
        module, _, name = processor.strip().rpartition(separator)
        if not module or not name:
            raise ValueError(f"logits processor {processor!r}: give it as 'module:Class' (or "
                             f"'module.Class')")
        return f"{module}:{name}"
    if not isinstance(processor, type):
        raise ValueError(f"logits processor {processor!r}: give a class or its 'module:Class' "
                         f"name, not an instance (each worker builds its own)")
    name = f"{processor.__module__}:{processor.__qualname__}"
    if "<locals>" in name or processor.__module__ == "__main__" or (
            _resolves_to(name) is not processor):
        raise ValueError(f"logits processor {processor.__qualname__}: the engine's processes "
                         f"import it by name ({name}); define it at the top level of an "
                         f"importable module")
    return name


def resolve(name: str) -> Any:
    """The object a `module:Attribute.Path` name stands for."""
    module_name, _, attribute = name.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _resolves_to(name: str) -> Any:
    try:
        return resolve(name)
    except Exception:  # not importable by its name: reported by the caller
        return None
