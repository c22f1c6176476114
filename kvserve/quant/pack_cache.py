"""Packed GGUF panels kept in the cache directory, so that a second load of the same file maps
them instead of packing every projection again.

Packing (`gguf_pack`: the file's blocks into our kernels' 16-row panels) reads the whole file
and writes a fresh copy of it; the copy's pages are faulted in as they are written. Mapped from
a file written on the first load, the panels cost nothing until a step touches them, and the
page cache usually holds them already. The cost is a second copy of the model on disk (the
file's size), so it is a switch: `KVSERVE_PACK_CACHE=0` turns it off; files under
`MIN_FILE_BYTES`, which pack in a fraction of a second, are never copied.

A model whose packed weights do not fit in the memory available (an MoE's experts, mostly) loads
with `spill=True`: each run is written to the cache file as soon as it is packed and served
from a copy-on-write map of it, so the panels are file pages the kernel reads in when a step
touches them and drops under memory pressure (llama.cpp's mmap), never anonymous memory the
process must hold. Steps then run at the disk's pace for whatever is not in the page cache.

The file is keyed by the GGUF's path, size and mtime (weights/cache.py) and by the panel
layout (`layout_fingerprint`); each run it serves is checked against a fresh pack of its first
rows, so a cache from a build whose layout differs is never used. A cache whose size disagrees
with its index (a truncated write, a full disk) is ignored and written again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from kvserve.errors import InsufficientMemoryError
from kvserve.kernels.reference import GGUF_FORMATS, INT4_PANEL
from kvserve.memory import return_freed_memory
from kvserve.weights.cache import _atomic_write, artifact_path

logger = logging.getLogger(__name__)

# bump whenever gguf_pack's output or a run's key changes (2: each expert's rows named apart)
PACK_LAYOUT_VERSION = 2
_ALIGN = 4096  # each run starts on a page of the file


# files smaller than this pack in well under a second: no copy of them on disk
MIN_FILE_BYTES = 64 << 20


def enabled(gguf_path: Path) -> bool:
    """Whether loads of this file use the cache: `KVSERVE_PACK_CACHE` (0: never) and size."""
    if os.environ.get("KVSERVE_PACK_CACHE", "1") == "0":
        return False
    return gguf_path.stat().st_size >= MIN_FILE_BYTES


def layout_fingerprint() -> str:
    text = f"{PACK_LAYOUT_VERSION}|{INT4_PANEL}|{sorted(GGUF_FORMATS.items())}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class PackCache:
    """The packed runs of one GGUF file: mapped from the cache where a complete one exists,
    else collected as they are packed and written by `save` after the load."""

    def __init__(self, gguf_path: Path, spill: bool = False):
        """`spill`: runs packed on a miss go to the cache file at once and are served from
        its map (a model larger than the memory available), not kept in memory until `save`."""
        base = artifact_path(gguf_path, f"packed-{layout_fingerprint()}")
        self.index_path = base.with_name(base.name + ".json")
        self.data_path = base.with_name(base.name + ".bin")
        self.entries: dict[str, tuple[int, list[int]]] = {}
        self.mapped: torch.Tensor | None = None
        self.packed: list[tuple[str, torch.Tensor]] = []  # a miss: what `save` writes
        self.hits = 0
        self._open()
        self.spill: _Spill | None = None
        if spill and self.mapped is None:
            _remove_abandoned_writes(self.data_path)
            self.spill = _Spill(self.data_path.with_name(
                f"{self.data_path.name}.partial-{os.getpid()}"))

    def _open(self) -> None:
        try:
            index = json.loads(self.index_path.read_text())
            size = self.data_path.stat().st_size
        except (OSError, ValueError):
            return
        if index.get("bytes") != size or size == 0:
            logger.warning("ignoring the packed-weights cache %s: %d bytes, its index says %s",
                           self.data_path, size, index.get("bytes"))
            return
        self.entries = {key: (offset, shape) for key, (offset, shape) in
                        index["entries"].items()}
        self.mapped = torch.from_file(str(self.data_path), shared=False, size=size,
                                      dtype=torch.uint8)

    def panels(self, run: list, pack: Callable[[list], torch.Tensor]) -> torch.Tensor:
        """The run's panels (`run`: its parts, QuantizedRows): a view of the mapped cache, or
        `pack(run)`'s. A view is checked first: its first panel must equal a fresh pack of the
        run's first rows (a few KB), so a cache of another layout or file is never served."""
        key = run_key(run)
        entry = self.entries.get(key) if self.mapped is not None else None
        if entry is None:
            panels = pack(run)
            if self.spill is not None:
                return self.spill.add(key, panels)
            if self.mapped is None:
                self.packed.append((key, panels))
            return panels
        offset, shape = entry
        view = self.mapped[offset:offset + _numel(shape)].view(shape)
        head = pack([run[0][:min(INT4_PANEL, run[0].shape[0])]])
        if not torch.equal(head[0], view[0]):
            logger.warning("the packed-weights cache %s differs from a fresh pack of %s: "
                           "packing it afresh", self.data_path, key)
            return pack(run)
        self.hits += 1
        return view

    def save(self, background: bool = True) -> threading.Thread | None:
        """Write the runs this load packed (none when the cache served it): data, then the
        index that makes it valid. In a background thread by default, so a first start
        serves while its copy goes to disk (the panels are the model's own tensors, never
        written to: the thread reads them as they are). The data goes to a file named by the
        pid, renamed when whole: a process that exits first leaves no index (the next load
        packs and writes again) and a partial file the next write removes. A failure (a full
        disk) is logged, never raised. Spilled runs are on disk already: their file is renamed
        and indexed here."""
        if self.spill is not None:
            spill, self.spill = self.spill, None
            self._publish(spill.finish(), spill.entries, spill.path)
            return None
        if not self.packed:
            return None
        packed, self.packed = self.packed, []
        if not background:
            self._write(packed)
            return None
        thread = threading.Thread(target=self._write, args=(packed,),
                                  name="kvserve-pack-cache", daemon=True)
        thread.start()
        return thread

    def _write(self, packed: list[tuple[str, torch.Tensor]]) -> None:
        entries, offset = {}, 0
        for key, panels in packed:
            offset = -(-offset // _ALIGN) * _ALIGN
            entries[key] = (offset, list(panels.shape))
            offset += panels.numel()
        started = time.perf_counter()
        _remove_abandoned_writes(self.data_path)
        partial = self.data_path.with_name(f"{self.data_path.name}.partial-{os.getpid()}")
        try:
            _write_data(partial, packed)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            logger.warning("could not write the packed-weights cache %s: %s", self.data_path,
                           exc)
            return
        self._publish(offset, entries, partial, started)

    def _publish(self, size: int, entries: dict, partial: Path,
                 started: float | None = None) -> None:
        """The whole data file `partial` becomes the cache: renamed, then indexed."""
        try:
            os.replace(partial, self.data_path)
            _atomic_write(self.index_path, lambda name: Path(name).write_text(
                json.dumps({"bytes": size, "entries": entries})))
        except OSError as exc:
            partial.unlink(missing_ok=True)
            logger.warning("could not write the packed-weights cache %s: %s", self.data_path,
                           exc)
            return
        took = "" if started is None else f", {time.perf_counter() - started:.1f}s"
        logger.info("packed weights cached in %s (%.0f MiB%s); the next load maps them",
                    self.data_path, size / 2**20, took)


class _Spill:
    """The cache file being written run by run as a load packs them (PackCache's `spill`):
    each run appended on a page boundary, then served from a copy-on-write map of its bytes
    (clean file pages: the kernel may drop them and read them again), its packed copy freed."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - open until finish()
        self.entries: dict[str, tuple[int, list[int]]] = {}
        self.size = 0

    def add(self, key: str, panels: torch.Tensor) -> torch.Tensor:
        """The run's panels written, then served from the file's map; the packed copy
        `panels` (the caller's last reference) is given back to the system."""
        offset = -(-self.size // _ALIGN) * _ALIGN
        try:
            self.file.seek(offset)
            self.file.write(memoryview(panels.contiguous().numpy()).cast("B"))
            self.file.flush()
            # on disk before the next run: dirty pages cannot be dropped until written, and a
            # memory cgroup (v1) kills a load whose dirty pages fill its limit
            os.fdatasync(self.file.fileno())
        except OSError as exc:  # a full disk: the weights fit neither in memory nor there
            self.file.close()
            self.path.unlink(missing_ok=True)
            raise InsufficientMemoryError(
                f"the weights do not fit in the memory available and writing them to "
                f"{self.path} to serve them from its map failed: {exc}") from exc
        self.size = offset + panels.numel()
        self.entries[key] = (offset, list(panels.shape))
        mapped = np.memmap(self.path, dtype=np.uint8, mode="c", offset=offset,
                           shape=(panels.numel(),))
        shape = panels.shape
        del panels
        # the freed copy stays in glibc's heap otherwise (its size raised malloc's mmap
        # threshold), and the heap grew by ~2.5 GB over OLMoE's load until its last trim
        return_freed_memory()
        return torch.from_numpy(mapped).view(shape)

    def finish(self) -> int:
        """Close the file; its size in bytes."""
        self.file.close()
        return self.size


def _write_data(path: Path, packed: list[tuple[str, torch.Tensor]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        for _, panels in packed:
            out.seek(-(-out.tell() // _ALIGN) * _ALIGN)
            out.write(memoryview(panels.contiguous().numpy()).cast("B"))


def _remove_abandoned_writes(data_path: Path) -> None:
    """Partial copies left by processes killed while writing (named by their pid)."""
    for partial in data_path.parent.glob(f"{data_path.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            partial.unlink(missing_ok=True)


def run_key(parts) -> str:
    """A run's identity in its file: each part's tensor name, rows, columns and type."""
    return "+".join(f"{p.name}:{p.shape[0]}x{p.cols}:{p.qtype}" for p in parts)


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
