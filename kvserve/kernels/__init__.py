"""Fused per-layer ops for decoder steps: the compiled C++ CPU kernels when they build, else the
torch reference versions with the same signatures. `get_ops(True)` is what the engine uses by
default; `get_ops(False)` (`--no-cpu-kernels`) runs the plain torch ops."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

from kvserve.kernels import reference
from kvserve.kernels.cpu_ext import build_failure, load_cpu_kernels

OP_NAMES = ("rms_norm", "add_rms_norm_", "silu_and_mul", "rope_and_cache_", "paged_attention_",
            "flash_attention_", "flash_attention_supported", "quantize_per_token",
            "dequantize_int32", "argmax_rows", "int4_linear", "int4_linear_fast")


def get_ops(use_cpu_kernels: bool = True) -> SimpleNamespace:
    """The op set, with `.compiled` telling whether it is the C++ one."""
    module: ModuleType | None = load_cpu_kernels() if use_cpu_kernels else None
    source = module if module is not None else reference
    ops = SimpleNamespace(**{name: getattr(source, name) for name in OP_NAMES})
    ops.compiled = module is not None
    return ops


__all__ = ["OP_NAMES", "build_failure", "get_ops", "load_cpu_kernels"]
