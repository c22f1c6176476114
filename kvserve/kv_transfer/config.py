"""Which KV connector an engine runs, which side of a transfer it is on, and its settings, from
`--kv-role` and/or vLLM's `--kv-transfer-config` JSON (`kv_connector`: a registered name or
"module:Class", default "TcpConnector"; `kv_connector_module_path`; `kv_role` kv_producer |
kv_consumer | kv_both; `kv_ip`, `kv_port`; `kv_connector_extra_config`, whose keys below are
read into fields and which a connector gets whole as `extra_config`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvserve.kv_transfer.factory import (
    DEFAULT_CONNECTOR,
    OFFLOADING_CONNECTOR,
    check_connector_name,
)
from kvserve.zmq_security import CurveKeys, require_secret

ROLES = ("prefill", "decode", "both")
_VLLM_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
LOAD_FAILURE_POLICIES = ("recompute", "fail")
TRANSPORTS = ("tcp", "shm")


@dataclass(frozen=True)
class KVTransferConfig:
    role: str  # prefill: computes prompts and holds their KV for a decode engine; decode:
    #            pulls it; both: either, per request
    host: str = "127.0.0.1"  # the address decode engines reach this one's KV at
    port: int = 0  # 0: any free port (the handle names the one bound)
    hold_timeout_s: float = 30.0  # a held request's blocks are freed if nobody pulls by then
    transfer_timeout_s: float = 10.0  # a pull that takes longer failed (a dead prefill engine)
    load_failure_policy: str = "recompute"  # or fail: the request ends with an error
    # tcp: frames over ZeroMQ; shm: through a /dev/shm file when both engines share a host
    # (else frames). tcp is the default: measured as fast or faster on one host
    # (benchmarks/kv_transfer.py, docs/performance-journal.md)
    transport: str = "tcp"
    connector: str = DEFAULT_CONNECTOR  # a registered name or "module:Class"
    # kv_connector_extra_config as given, for connectors with settings of their own
    extra_config: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"kv role {self.role!r}: choose one of {', '.join(ROLES)}")
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv load failure policy {self.load_failure_policy!r}: choose one "
                             f"of {', '.join(LOAD_FAILURE_POLICIES)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv transport {self.transport!r}: choose one of "
                             f"{', '.join(TRANSPORTS)}")
        if self.hold_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("kv hold and transfer timeouts must be positive")

    def check_binds(self, keys: CurveKeys | None) -> None:
        """A ZmqSecurityError when the built-in connector's KV sender would bind beyond
        loopback without the shared secret (zmq_security.py): pullers read the KV cache."""
        if self.connector == DEFAULT_CONNECTOR and self.produces:
            require_secret(self.host, "--kv-transfer-config kv_ip", keys)

    @property
    def produces(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("decode", "both")


def kv_transfer_config(role: str | None, config_json: str | None,
                       offload: dict | None = None) -> KVTransferConfig | None:
    """The engine's KV transfer settings, or None when it takes no part in transfers. `role`
    (--kv-role) wins over the JSON's kv_role. `offload`: the --kv-offload-* flags' tiers, as
    the OffloadingConnector's extra config."""
    if offload is not None:
        if role is not None or config_json:
            raise ValueError("the KV offload tiers (--kv-offload-*, --kv-offloading-size) and "
                             "--kv-role/--kv-transfer-config cannot be combined yet: one KV "
                             "connector per engine")
        return KVTransferConfig("both", connector=OFFLOADING_CONNECTOR, extra_config=offload)
    settings: dict = {}
    if config_json:
        try:
            raw = json.loads(config_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        settings = _from_vllm_keys(raw)
    if role is not None:
        settings["role"] = role
    if "role" not in settings:
        if config_json:
            raise ValueError("--kv-transfer-config needs kv_role (or pass --kv-role)")
        return None
    return KVTransferConfig(**settings)


def _from_vllm_keys(raw: dict) -> dict:
    settings: dict = {}
    connector = raw.get("kv_connector")
    if raw.get("kv_connector_module_path"):
        connector = f"{raw['kv_connector_module_path']}:{connector or ''}"
    if connector:
        settings["connector"] = check_connector_name(str(connector))
    if "kv_role" in raw:
        role = raw["kv_role"]
        settings["role"] = _VLLM_ROLES.get(role, role)
    if raw.get("kv_ip"):
        settings["host"] = str(raw["kv_ip"])
    if raw.get("kv_port") is not None:
        settings["port"] = int(raw["kv_port"])
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    settings["extra_config"] = dict(extra)
    for key in ("hold_timeout_s", "transfer_timeout_s", "load_failure_policy", "transport"):
        if key in extra:
            settings[key] = extra[key]
    return settings
