"""The handle a request carries between engines, in the OpenAI body as `kv_transfer_params`
(vLLM's field and key names, so its proxies and ours speak the same JSON)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.errors import InvalidRequestError


class KVTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """To a prefill engine: `do_remote_decode` (keep the KV for a decode engine). From it, and
    then to a decode engine: `do_remote_prefill` with where the KV is. A prefill engine with
    several ranks (tensor x pipeline) serves each rank's shard of the blocks from that rank:
    `remote_hosts` / `remote_ports` name every rank's sender in rank order (`remote_host` /
    `remote_port` are rank 0's), and a decode engine needs the same `tp_size` and `pp_size`."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] = []
    remote_host: str | None = None
    remote_port: int | None = None
    num_prompt_tokens: int = 0  # the prompt the blocks hold (the decode side checks its own)
    remote_hosts: list[str] = []  # one per rank when the prefill engine has several
    remote_ports: list[int] = []
    tp_size: int = 1
    pp_size: int = 1

    @property
    def wants_load(self) -> bool:
        return (self.do_remote_prefill and bool(self.remote_block_ids)
                and self.remote_host is not None and self.remote_port is not None
                and self.remote_request_id is not None)

    @property
    def remote_addresses(self) -> list[tuple[str, int]]:
        """(host, port) of each rank's sender, rank order."""
        if self.remote_ports:
            return list(zip(self.remote_hosts, self.remote_ports))
        return [(self.remote_host, self.remote_port)]

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def parse_kv_transfer_params(value: Any) -> KVTransferParams | None:
    """The body's `kv_transfer_params` (a JSON object), or None; anything malformed is a 400."""
    if value is None:
        return None
    try:
        return msgspec.convert(value, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"kv_transfer_params: {exc}") from exc
