"""General plugins: code that a deployment (or a test suite) asks kvserve to run once at
start-up in every process of an engine: the front-end, the engine core and each worker.

`KVSERVE_PLUGINS` names them as comma-separated `module:function` entries (vLLM's
`VLLM_PLUGINS` idea, without entry-point discovery: nothing runs unless the variable names it).
Child processes inherit the variable, and the Ray executor copies `KVSERVE_*` variables into its
actors, so every rank runs the same plugins. A plugin that fails to load is a clear error at
start-up, never a silent skip.
"""

from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger(__name__)

ENV_VAR = "KVSERVE_PLUGINS"
_loaded: set[str] = set()


class PluginError(RuntimeError):
    """A plugin named in KVSERVE_PLUGINS could not be imported or run."""


def load_plugins() -> None:
    """Run each plugin named in KVSERVE_PLUGINS that this process has not run yet."""
    for entry in filter(None, (part.strip() for part in os.environ.get(ENV_VAR, "").split(","))):
        if entry in _loaded:
            continue
        module_name, _, function_name = entry.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name or "register")
            function()
        except Exception as exc:
            raise PluginError(f"plugin {entry!r} from {ENV_VAR} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        _loaded.add(entry)
        logger.info("plugin %s loaded", entry)
