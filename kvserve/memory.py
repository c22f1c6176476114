"""How much memory this machine (or its cgroup) can still give us, and the load-time check that
refuses a model or KV cache that cannot fit with a typed error naming the bytes, instead of an
OOM kill half-way through loading. Standard library only, so any layer may ask."""

from __future__ import annotations

import os
from pathlib import Path

from kvserve.errors import InsufficientMemoryError

# `KVSERVE_MEMORY_CHECK=0` skips the check (a machine with swap, or an estimate that is wrong
# for an unusual checkpoint); `KVSERVE_AVAILABLE_MEMORY_BYTES` replaces what /proc says (tests,
# or a budget smaller than the machine)
CHECK_ENV = "KVSERVE_MEMORY_CHECK"
AVAILABLE_ENV = "KVSERVE_AVAILABLE_MEMORY_BYTES"
CGROUP = Path("/sys/fs/cgroup")


def available_memory_bytes() -> int | None:
    """The smaller of /proc/meminfo's MemAvailable and the cgroup's remaining allowance
    (memory.max - memory.current, cgroup v2); None where neither can be read."""
    override = os.environ.get(AVAILABLE_ENV)
    if override:
        return int(override)
    limits = [value for value in (_mem_available(), _cgroup_remaining()) if value is not None]
    return min(limits) if limits else None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_remaining() -> int | None:
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def check_fits(needed: int, what: str, parts: dict[str, int] | None = None,
               advice: str = "") -> None:
    """Raise InsufficientMemoryError when `needed` bytes exceed what is available. `parts`:
    the bytes by what needs them, named in the message."""
    if os.environ.get(CHECK_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    available = available_memory_bytes()
    if available is None or needed <= available:
        return
    detail = ", ".join(f"{name} {_gib(size)}" for name, size in (parts or {}).items())
    raise InsufficientMemoryError(
        f"{what} needs about {_gib(needed)} ({needed:,} bytes{': ' + detail if detail else ''})"
        f" but {_gib(available)} ({available:,} bytes) of memory is available"
        f"{'; ' + advice if advice else ''} ({CHECK_ENV}=0 skips this check)")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def return_freed_memory() -> None:
    """Give the heap pages freed since the last call back to the system (glibc's malloc_trim):
    a load parses large JSON and metadata whose garbage glibc would otherwise keep as this
    process's RSS for its whole life (about 40 MB after a 128K-vocab tokenizer). A no-op where
    the C library has no malloc_trim."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library this process already runs on
    except (OSError, AttributeError):
        return
    trim(0)
