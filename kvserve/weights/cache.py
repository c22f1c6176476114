"""On-disk cache of what a GGUF file costs seconds to parse: its config and tokenizer (a few KB
to MB of JSON; the weights are read from the file itself each load, never copied here).

Entries are keyed by the GGUF's absolute path, size and mtime plus a format version, so an
edited file is parsed again. The directory is `$KVSERVE_CACHE_DIR`, else
`$XDG_CACHE_HOME/kvserve`, else `~/.cache/kvserve`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from kvserve.paths import cache_dir

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 7  # 4: configs hold sliding windows; 5: Gemma fields, norms less 1;
# 6: partial rotary (Q/K rows in our head order), YaRN and LongRoPE configs, Phi-3 names;
# 7: weights under HF's names and layout (each tensor as the GGUF dequantizes)


def artifact_path(gguf_path: Path, suffix: str) -> Path:
    """Where an artifact derived from this exact GGUF file lives (may not exist yet)."""
    stat = gguf_path.stat()
    key_text = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{CACHE_FORMAT_VERSION}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:24]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}.{suffix}"


def _atomic_write(destination: Path, write: Callable[[str], None]) -> None:
    """Write to a temp file then rename, so a crash never leaves a half-written entry."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=destination.parent, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp_name)
        os.replace(tmp_name, destination)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def cached_json(gguf_path: Path, suffix: str, compute: Callable[[], Any],
                use_cache: bool = True) -> Any:
    """Return the cached JSON artifact, computing and storing it on a miss."""
    path = artifact_path(gguf_path, suffix)
    if use_cache and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            logger.warning("ignoring unreadable cache entry %s", path)
    value = compute()
    if use_cache:
        try:
            _atomic_write(path, lambda name: Path(name).write_text(json.dumps(value)))
        except OSError as exc:
            logger.warning("could not write cache entry %s: %s", path, exc)
    return value
