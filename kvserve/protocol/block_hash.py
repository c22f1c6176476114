"""Stable chained hashes of full KV blocks: the same tokens give the same 64-bit hash in every
process, on every start, whatever PYTHONHASHSEED says, so replicas and a router can compare
them (KV events, kvserve/kv_events.py).

hash(block) = blake2b-64(parent's hash as 8 bytes little-endian + token ids as int32
little-endian), with a fixed root in place of the first block's parent. Python's `hash()` did
not do: `hash(None)` is address-based on 3.11, so a tuple holding it differs per process.

A cache salt (vLLM's `cache_salt`, and the tenant of a multi-key server) replaces that root
with one of its own, so requests with different salts never share a block anywhere (pool,
tiers, routers): one tenant cannot learn another's prompts from prefix-cache timing.
"""

from __future__ import annotations

import struct
from hashlib import blake2b
from typing import Sequence

# what routers compare before trusting our hashes; bump with any change below
HASH_ALGORITHM = "blake2b64-int32le-v1"

ROOT_HASH = int.from_bytes(blake2b(b"kvserve block hash root", digest_size=8).digest(),
                           "little")

_PARENT = struct.Struct("<Q")
_TOKEN_FORMATS: dict[int, struct.Struct] = {}


def _tokens_format(count: int) -> struct.Struct:
    fmt = _TOKEN_FORMATS.get(count)
    if fmt is None:
        fmt = _TOKEN_FORMATS[count] = struct.Struct(f"<{count}i")
    return fmt


def salted_root(cache_salt: str | None) -> int | None:
    """The parent hash a salted sequence's first block chains from (None: unsalted, the
    common root)."""
    if not cache_salt:
        return None
    digest = blake2b(b"kvserve cache salt\0" + cache_salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The hash of one full block whose parent block hashed to `parent_hash` (None: the
    first block of a sequence)."""
    data = _PARENT.pack(ROOT_HASH if parent_hash is None else parent_hash) \
        + _tokens_format(len(token_ids)).pack(*token_ids)
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                 cache_salt: str | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids` (at most `max_blocks`)."""
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes: list[int] = []
    parent = salted_root(cache_salt)
    for index in range(count):
        parent = hash_block_tokens(parent, token_ids[index * block_size:(index + 1) * block_size])
        hashes.append(parent)
    return hashes
