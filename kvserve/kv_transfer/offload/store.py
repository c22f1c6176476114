"""The disk tier's files: one per block and rank, `<hash:016x>.r<rank>.kv` in a folder named
by the engine's KV layout fingerprint (another model, dtype, block size or parallel layout
never reads them).

A file is a fixed header (magic, layout fingerprint, block hash, rank, payload length, the
payload's CRC-32: a block is written ~4x faster than with blake2b, and this guards against
torn and damaged files, not against someone forging them) and the payload: the rank's K and V of that block for each of
its layers. It is written to a temporary name and renamed into place, so a reader never sees
a half-written file under the real name; a kill -9 mid-write leaves only a `.tmp` file, which
the next start removes. A file that fails any check is refused (and deleted): its block is
recomputed, never served."""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"KVSVBLK2"
_HEADER = struct.Struct("<8s16sQIQI")  # magic, fingerprint, hash, rank, length, CRC-32
SUFFIX = ".kv"


class CorruptBlockError(Exception):
    """A tier file that is missing, truncated, or not what its name says."""


def layout_folder(root: str | os.PathLike, fingerprint: bytes) -> Path:
    return Path(root) / fingerprint.hex()


def block_file(folder: Path, block_hash: int, rank: int) -> Path:
    return folder / f"{block_hash:016x}.r{rank}{SUFFIX}"


def _checksum(payload: bytes | memoryview) -> int:
    return zlib.crc32(payload)


def write_block(folder: Path, fingerprint: bytes, block_hash: int, rank: int,
                payload: bytes | memoryview) -> None:
    """Write atomically (temporary file, then rename). OSError (a full disk) propagates, with
    the temporary file removed."""
    path = block_file(folder, block_hash, rank)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    header = _HEADER.pack(MAGIC, fingerprint, block_hash, rank, len(payload),
                          _checksum(payload))
    try:
        with open(temporary, "wb") as handle:
            handle.write(header)
            handle.write(payload)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_block(folder: Path, fingerprint: bytes, block_hash: int, rank: int,
               expected_length: int) -> bytes:
    """The payload, checked; CorruptBlockError (after deleting the file) when anything is
    off."""
    path = block_file(folder, block_hash, rank)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptBlockError(f"{path.name}: {exc.strerror or exc}") from exc
    problem = _problem(data, fingerprint, block_hash, rank, expected_length)
    if problem:
        path.unlink(missing_ok=True)
        raise CorruptBlockError(f"{path.name}: {problem}; deleted")
    return data[_HEADER.size:]


def _problem(data: bytes, fingerprint: bytes, block_hash: int, rank: int,
             expected_length: int) -> str:
    if len(data) < _HEADER.size:
        return "truncated header"
    magic, theirs, their_hash, their_rank, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not a kvserve block file"
    if (theirs, their_hash, their_rank) != (fingerprint, block_hash, rank):
        return "another layout's, block's or rank's file"
    if length != expected_length or len(data) - _HEADER.size != length:
        return f"payload of {len(data) - _HEADER.size} bytes, expected {expected_length}"
    if _checksum(memoryview(data)[_HEADER.size:]) != checksum:
        return "checksum mismatch"
    return ""


def scan(folder: Path, world_size: int) -> list[int]:
    """Hashes with a file for every rank, oldest first (by modification time); leftover
    temporary files (a write cut short) are removed."""
    if not folder.is_dir():
        return []
    ranks: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.scandir(folder):
        name = entry.name
        if name.endswith(".tmp"):
            Path(entry.path).unlink(missing_ok=True)
            continue
        parsed = _parse(name)
        if parsed is None:
            continue
        block_hash, _ = parsed
        ranks[block_hash] = ranks.get(block_hash, 0) + 1
        times[block_hash] = max(times.get(block_hash, 0.0), entry.stat().st_mtime)
    whole = [h for h, count in ranks.items() if count == world_size]
    return sorted(whole, key=times.__getitem__)


def _parse(name: str) -> tuple[int, int] | None:
    if not name.endswith(SUFFIX):
        return None
    stem, _, rank = name[:-len(SUFFIX)].partition(".r")
    try:
        return int(stem, 16), int(rank)
    except ValueError:
        return None


def remove_block(folder: Path, block_hash: int, rank: int) -> None:
    block_file(folder, block_hash, rank).unlink(missing_ok=True)
