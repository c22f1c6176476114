"""Where kvserve keeps what it builds once per machine: converted weights, compiled kernels,
autotune tables. Standard library only, so any layer may ask."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$KVSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvserve`, else `~/.cache/kvserve`."""
    explicit = os.environ.get("KVSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvserve"
