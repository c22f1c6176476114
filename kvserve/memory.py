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
PROC_CGROUP = Path("/proc/self/cgroup")  # which cgroup this process is in (v1: per controller)


def available_memory_bytes() -> int | None:
    """The smaller of /proc/meminfo's MemAvailable and the cgroup's remaining allowance
    (cgroup v2: memory.max - memory.current; v1: this process's memory cgroup's limit - usage
    + its inactive file pages, which the kernel reclaims first); None where neither can be
    read."""
    override = os.environ.get(AVAILABLE_ENV)
    if override:
        return int(override)
    limits = [value for value in (_mem_available(), _cgroup_remaining(), _cgroup_v1_remaining())
              if value is not None]
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


# cgroup v1 reports "no limit" as a page-rounded 2^63 - 1
_V1_UNLIMITED = 1 << 62


def _cgroup_v1_remaining() -> int | None:
    try:
        path = next(line.split(":", 2)[2] for line in
                    PROC_CGROUP.read_text().splitlines()
                    if line.split(":", 2)[1] == "memory")
        group = CGROUP / "memory" / path.lstrip("/")
        limit = int((group / "memory.limit_in_bytes").read_text())
        if limit >= _V1_UNLIMITED:
            return None
        usage = int((group / "memory.usage_in_bytes").read_text())
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        return limit - usage + int(stat.get("total_inactive_file", 0))
    except (OSError, ValueError, IndexError, StopIteration):
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
