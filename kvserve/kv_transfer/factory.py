"""KV connectors by name: `--kv-transfer-config`'s `kv_connector` is a registered name
("TcpConnector", the built-in P/D transfer) or "module:Class" for a connector outside kvserve
(imported in the engine core and in every worker). A plugin (`KVSERVE_PLUGINS`, run in every
process of an engine) may `register_connector` more names."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvserve.plugins import load_plugins

if TYPE_CHECKING:
    from kvserve.kv_transfer.base import (
        KVConnectorBase,
        KVConnectorContext,
        KVConnectorRole,
    )
    from kvserve.kv_transfer.config import KVTransferConfig

DEFAULT_CONNECTOR = "TcpConnector"
OFFLOADING_CONNECTOR = "OffloadingConnector"  # the KV offload tiers (vLLM's name)
# "KVServeConnector": the name it had before connectors were pluggable (configs still say it)
_ALIASES = {"KVServeConnector": DEFAULT_CONNECTOR}
_registry: dict[str, str | type] = {
    DEFAULT_CONNECTOR: "kvserve.kv_transfer.connector:TcpConnector",
    OFFLOADING_CONNECTOR: "kvserve.kv_transfer.offload.connector:OffloadingConnector",
}


def register_connector(name: str, target: str | type) -> None:
    """Make `name` mean `target` (a KVConnectorBase subclass, or "module:Class" imported when
    first built)."""
    _registry[name] = target


def check_connector_name(name: str) -> str:
    """The registered name (aliases resolved) or the "module:Class" given; a ValueError naming
    the choices for anything else (vLLM's own connectors included)."""
    name = _ALIASES.get(name, name)
    if ":" in name:
        module, _, attribute = name.partition(":")
        if module and attribute:
            return name
    load_plugins()  # plugins may register names; they run once per process
    if name not in _registry:
        raise ValueError(f"kv_connector {name!r} is not a kvserve connector: choose one of "
                         f"{', '.join(sorted(_registry))} or give 'module:Class' (vLLM's "
                         f"connectors, e.g. NixlConnector, do not run here)")
    return name


def connector_class(name: str) -> type[KVConnectorBase]:
    from kvserve.kv_transfer.base import KVConnectorBase

    target = _registry.get(name, name)
    if isinstance(target, str):
        module, _, attribute = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"kv_connector {name!r}: cannot import {target!r}: {exc}") from exc
    if not (isinstance(target, type) and issubclass(target, KVConnectorBase)):
        raise ValueError(f"kv_connector {name!r} is not a KVConnectorBase subclass")
    return target


def make_connector(config: KVTransferConfig, role: KVConnectorRole,
                   context: KVConnectorContext) -> KVConnectorBase:
    """The connector `config` names, built for one role."""
    return connector_class(check_connector_name(config.connector))(config, role, context)
