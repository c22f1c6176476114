"""The shared-memory path of a pull, when both engines are on one host.

The sender gathers the held blocks straight into a fresh /dev/shm file (one copy) and answers
with its name instead of data frames; the puller opens it, unlinks it at once (so a crash after
that leaves nothing), maps it and copies the blocks into its KV tensors (the second and last
copy). Against the TCP path this saves the socket's copies and the loopback's wake-ups. Files
a puller never opened are unlinked by the sender after the transfer timeout, and a sender
removes the files of earlier senders whose process is gone.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
import warnings
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
# fault the file's pages in with one call rather than one 4 KiB fault at a time
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
PREFIX = "kvserve-kv-"


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def write_blocks(kv_caches: list[torch.Tensor], index: torch.Tensor) -> str:
    """Gather blocks `index` of every layer into a new /dev/shm file; its path. Raises OSError
    (e.g. /dev/shm full) after removing what it wrote. Each layer's cache is its page layout's
    [planes, blocks, block_size, ...] (attention/kv_tensors.py), layers of any shapes, one
    dtype."""
    shapes = block_run_shapes(kv_caches, len(index))
    path = SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        size = sum(shape.numel() for shape in shapes) * kv_caches[0].element_size()
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=_MAP_FLAGS) as mapping:
            flat = _view(mapping, kv_caches[0].dtype)
            for cache, out in zip(kv_caches, _layers(flat, shapes)):
                torch.index_select(cache, 1, index, out=out)
                del out
            del flat
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return str(path)


def read_blocks(path: str, kv_caches: list[torch.Tensor], index: torch.Tensor,
                num_blocks: int) -> None:
    """Copy the first len(index) of the file's `num_blocks` blocks per layer into blocks
    `index` of kv_caches; the file is unlinked first."""
    fd = os.open(path, os.O_RDONLY)
    os.unlink(path)
    try:
        shapes = block_run_shapes(kv_caches, num_blocks)
        size = sum(shape.numel() for shape in shapes) * kv_caches[0].element_size()
        with mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ) as mapping:
            flat = _view(mapping, kv_caches[0].dtype)
            count = len(index)
            for cache, layer in zip(kv_caches, _layers(flat, shapes)):
                cache.index_copy_(1, index, layer[:, :count])
                del layer
            del flat
    finally:
        os.close(fd)


def block_run_shapes(kv_caches: list[torch.Tensor], num_blocks: int) -> list[torch.Size]:
    """Each layer's shape for `num_blocks` of its blocks (its cache with dim 1 resized)."""
    return [torch.Size([cache.shape[0], num_blocks, *cache.shape[2:]]) for cache in kv_caches]


def _layers(flat: torch.Tensor, shapes: list[torch.Size]):
    """Consecutive views of `flat`, one per shape."""
    offset = 0
    for shape in shapes:
        yield flat[offset:offset + shape.numel()].view(shape)
        offset += shape.numel()


def _view(mapping: mmap.mmap, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype)


class ShmJanitor:
    """The sender's files: unlinked when a puller has not taken them in `timeout_s`; at start,
    the files of senders that are gone."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._files: list[tuple[float, str]] = []
        _remove_orphans()

    def created(self, path: str) -> None:
        self._files.append((time.monotonic(), path))

    def sweep(self) -> None:
        cutoff = time.monotonic() - self.timeout_s
        while self._files and self._files[0][0] < cutoff:
            Path(self._files.pop(0)[1]).unlink(missing_ok=True)

    def close(self) -> None:
        for _, path in self._files:
            Path(path).unlink(missing_ok=True)
        self._files.clear()


def _remove_orphans() -> None:
    if not SHM_DIR.is_dir():
        return
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
