"""Build (once per instruction-set level) and load the C++ CPU kernels in kvserve/kernels/csrc
with torch's JIT extension builder.

Every level of `isa.LEVELS` the machine can execute is a separate build of the same sources with
its own -march flags (x86-64-v3 for AVX2, v4 for AVX-512, plus BF16/VNNI), so the AVX2 variants
can be built, tested and benchmarked on any AVX-512 machine. A build lands in the kvserve cache
directory, keyed by a hash of every source and header, the torch version and the level's flags,
so later starts only load a .so (~0.1 s). `make install` builds the selected level ahead of time
and fails if it does not build. A level that cannot build (no compiler, a broken `CXX`, missing
headers) is a `KernelBuildError` naming the level and the compiler's error, never a silent switch
to the torch reference ops: those run only when asked for (`KVSERVE_KERNELS=reference` or
`--no-cpu-kernels`, see `kvserve/kernels/__init__.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from kvserve.errors import KernelBuildError
from kvserve.kernels import isa
from kvserve.paths import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
# -fvisibility=hidden: several levels' modules live in one process; each must bind to its own
# copies of the kernels, never to another level's symbols of the same name.
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden"]
_GIST_CHARS = 400
_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}
_failures: dict[str, str] = {}


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """A digest of the kernels' C++ sources: part of each build's name, and of the autotuner's
    table key (what its timings were measured with)."""
    texts = [path.read_text() for path in SOURCES + HEADERS]
    return hashlib.sha256("|".join(texts).encode()).hexdigest()[:16]


def _build_name(level: str) -> str:
    # the source directory too: torch's build.ninja records absolute source paths, so two
    # checkouts sharing one cache would otherwise rebuild each other's builds in turn
    key = "|".join([sources_digest(), str(SOURCES[0].parent.resolve()), torch.__version__,
                    level, *_COMMON_FLAGS, *isa.compiler_flags(level)])
    return f"kvserve_cpu_{level}_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _put_environment_bin_on_path() -> None:
    """torch finds `ninja` on PATH; the pip-installed one sits next to this Python, which is not
    on PATH when the venv is not activated (e.g. `.venv/bin/python -m ...`)."""
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def load_cpu_kernels(level: str | None = None) -> ModuleType | None:
    """The compiled module for `level` (default: `isa.selected_level()`), or None (with the
    reason in `build_failure(level)`) if it cannot build or the CPU cannot execute it."""
    level = level or isa.selected_level()
    isa.compiler_flags(level)  # an unknown level name is an UnknownIsaError, not a failed build
    with _lock:
        if level in _loaded or level in _failures:
            return _loaded.get(level)
        if level not in isa.machine_levels():
            _failures[level] = f"this CPU cannot execute {level} code"
            return None
        _loaded_or_failure(level)
        return _loaded.get(level)


def require_cpu_kernels(level: str | None = None) -> ModuleType:
    """The compiled module for `level`, or a KernelBuildError that names the level, the
    compiler's error and the way out."""
    level = level or isa.selected_level()
    module = load_cpu_kernels(level)
    if module is None:
        raise KernelBuildError(
            f"the C++ CPU kernels ({level}) are unavailable: {build_failure(level)}. Install a "
            "working C++ compiler (torch builds with $CXX, else c++), or set "
            "KVSERVE_KERNELS=reference (or pass --no-cpu-kernels) to run the slower torch "
            "reference ops instead")
    return module


def _loaded_or_failure(level: str) -> None:
    from torch.utils import cpp_extension

    _put_environment_bin_on_path()
    name = _build_name(level)
    build_dir = cache_dir() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        with _exclusive_build(build_dir):
            module = cpp_extension.load(
                name=name, sources=[str(path) for path in SOURCES],
                build_directory=str(build_dir),
                extra_cflags=_COMMON_FLAGS + isa.compiler_flags(level),
                extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, a broken one, missing headers
        log = build_dir / "build-error.log"
        log.write_text(f"{type(error).__name__}: {error}\n")
        compiler = os.environ.get("CXX") or "c++"
        _failures[level] = (f"the build failed (compiler {compiler!r}): {error_gist(error)} "
                            f"(full output: {log})")
        logger.debug("CPU kernels (%s): %s", level, _failures[level])
        return
    module.isa = level
    _loaded[level] = module
    logger.info("CPU kernels: %s build loaded in %.1fs", level, time.perf_counter() - start)


@contextlib.contextmanager
def _exclusive_build(build_dir: Path):
    """One builder per build directory, by an flock the kernel releases when its holder dies.
    torch's own lock is a file whose mere existence means "busy": a build killed mid-way (a
    test timeout, kill -9) leaves it behind and every later load waits for it forever. Under
    our flock nobody else is building, so such a file is stale and is removed."""
    with open(build_dir / ".kvserve-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def error_gist(error: BaseException) -> str:
    """The line of a failed build that says what went wrong: the compiler's first `error`
    line, else ninja's FAILED line, else the exception's first line (e.g. a compiler that
    does not even answer `--version`)."""
    if isinstance(error, subprocess.CalledProcessError):
        command = error.cmd if isinstance(error.cmd, str) else " ".join(map(str, error.cmd))
        said = error.output.decode(errors="replace") if isinstance(error.output, bytes) \
            else str(error.output or "")
        first = next((line.strip() for line in said.splitlines() if line.strip()), "")
        gist = f"`{command}` exited with status {error.returncode}"
        return (f"{gist}: {first}" if first else gist)[:_GIST_CHARS]
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    details = [line for line in lines
               if not line.startswith(("Error building extension", "ninja: "))]
    for pattern in (r"\berror:", r"^FAILED:"):
        for line in details:
            if re.search(pattern, line, re.IGNORECASE):
                return line[:_GIST_CHARS]
    return (lines[0] if lines else type(error).__name__)[:_GIST_CHARS]


def build_failure(level: str | None = None) -> str | None:
    return _failures.get(level or isa.selected_level())
