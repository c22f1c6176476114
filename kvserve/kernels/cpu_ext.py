"""Build (once) and load the C++ CPU kernels in kvserve/kernels/csrc with torch's JIT extension
builder. The build lands in the kvserve cache directory, keyed by a hash of every source and
header, the torch version and the CPU's instruction-set flags, so later starts only load a .so
(~0.1 s).

`make install` builds it ahead of time; if no compiler is present the engine falls back to the
torch reference ops (kvserve/kernels/reference.py) and says why in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from kvserve.weights.cache import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
_lock = threading.Lock()
_loaded: ModuleType | None = None
_failure: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_name() -> str:
    texts = [path.read_text() for path in SOURCES + HEADERS]
    key = "|".join(texts + [torch.__version__, _cpu_flags()])
    return "kvserve_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _put_environment_bin_on_path() -> None:
    """torch finds `ninja` on PATH; the pip-installed one sits next to this Python, which is not
    on PATH when the venv is not activated (e.g. `.venv/bin/python -m ...`)."""
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def load_cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (with the reason in `build_failure()`) if it cannot build."""
    global _loaded, _failure
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded
        from torch.utils import cpp_extension

        _put_environment_bin_on_path()
        name = _build_name()
        build_dir = cache_dir() / "kernels" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            _loaded = cpp_extension.load(
                name=name, sources=[str(path) for path in SOURCES], build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as error:  # no compiler, no headers: run the reference ops instead
            _failure = f"{type(error).__name__}: {error}"
            logger.warning("CPU kernels unavailable, using torch ops: %s", _failure)
        return _loaded


def build_failure() -> str | None:
    return _failure
