"""Facts about the machine that change defaults: bf16 support, thread counts."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: oneDNN runs bf16 GEMMs natively (twice fp32's rate here)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype(device: str) -> torch.dtype:
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op (OpenMP) threads for the engine; None keeps torch's default (one per
    core). The C++ kernels and torch's GEMMs share this pool; the server's event loop runs while
    kernels release the GIL."""
    if num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()
