"""x86 instruction-set levels of the compiled CPU kernels: which ones this machine can execute,
which one the engine uses (`KVSERVE_CPU_ISA` caps it), and the compiler flags of each.

Every level is a separate build of the same sources (`cpu_ext.py`), so any machine can build,
test and benchmark every level at or below its own: an AVX-512 machine runs the AVX2 variants
with `KVSERVE_CPU_ISA=avx2`. Nothing here assumes the CPU the code was tuned on.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

ISA_ENV = "KVSERVE_CPU_ISA"
# Lowest to highest. "scalar" is the portable build (plain loops, whatever the compiler makes of
# them); every x86 level below adds vector paths. `avx512_vnni` is AVX-512 with integer dot
# products and no bf16 ones (Intel Cascade Lake: its w4a8 kernels take a whole 16-output panel
# per `vpdpbusd`); `avx512_bf16` adds bf16 dot products (AMD Zen 4/5, Intel Sapphire Rapids on).
LEVELS = ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16")
# What each level needs from /proc/cpuinfo's flags (x86-64-v3 / -v4, plus BF16 dot products).
_REQUIRED_FLAGS = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "avx512": ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "avx512_vnni": ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                    "avx512_vnni"),
    "avx512_bf16": ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                    "avx512_bf16", "avx512_vnni"),
}
_COMPILER_FLAGS = {
    "scalar": [],
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512_vnni": ["-march=x86-64-v4", "-mavx512vnni"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
}


class UnknownIsaError(ValueError):
    """KVSERVE_CPU_ISA names no level."""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is absent)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.lru_cache(maxsize=1)
def machine_levels() -> tuple[str, ...]:
    """Every level this CPU can execute, lowest first ("scalar" always)."""
    if not _is_x86():
        return ("scalar",)
    flags = cpu_flags()
    return tuple(level for level in LEVELS if all(flag in flags for flag in _REQUIRED_FLAGS[level]))


def tested_levels() -> tuple[str, ...]:
    """The levels the tests run every kernel and equivalence test at, lowest first: the
    portable build, AVX2, and this CPU's AVX-512 levels that some CPU family stops at and runs
    by default (VNNI without bf16: Cascade Lake; bf16: Zen 4/5, Sapphire Rapids). Plain
    AVX-512 (Skylake) is tested where it is the machine's best: elsewhere its code is the AVX2
    source built for AVX-512 and the VNNI level's without the integer dot products."""
    levels = machine_levels()
    return tuple(level for level in levels
                 if level != "avx512" or level == levels[-1])


def best_level() -> str:
    return machine_levels()[-1]


def selected_level() -> str:
    """The level the engine builds and uses: the machine's best, capped by KVSERVE_CPU_ISA."""
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    if not cap:
        return best_level()
    if cap not in LEVELS:
        raise UnknownIsaError(f"{ISA_ENV}={cap!r}: choose one of {', '.join(LEVELS)}")
    available = machine_levels()
    if cap in available:
        return cap
    below = [level for level in available if LEVELS.index(level) <= LEVELS.index(cap)]
    return below[-1] if below else available[0]


def compiler_flags(level: str) -> list[str]:
    """-march flags for a level; non-x86 machines build only "scalar" (with -mcpu=native)."""
    if level not in LEVELS:
        raise UnknownIsaError(f"unknown CPU ISA level {level!r}; choose one of {', '.join(LEVELS)}")
    if not _is_x86():
        return ["-mcpu=native"]
    return list(_COMPILER_FLAGS[level])


def has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: oneDNN runs bf16 GEMMs natively (else torch emulates them, ~100x
    slower at batch sizes above one)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.lru_cache(maxsize=1)
def cpu_description() -> dict[str, str]:
    """lscpu's model name, family and model number, for benchmark reports and cache keys."""
    fields = {"model_name": "", "family": "", "model": ""}
    keys = {"model name": "model_name", "cpu family": "family", "model": "model"}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            key = keys.get(name.strip())
            if key and not fields[key]:
                fields[key] = value.strip()
            if line.strip() == "":
                break
    except OSError:
        fields["model_name"] = platform.processor()
    return fields
