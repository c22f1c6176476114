"""Fused per-layer ops for decoder steps: the compiled C++ CPU kernels when they build, else the
torch reference versions with the same signatures. `get_ops(True)` is what the engine uses by
default (the build for `isa.selected_level()`); `get_ops(True, level)` forces one level (tests run
every level the machine can execute); `get_ops(False)` (`--no-cpu-kernels`) runs the plain torch
ops."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

from kvserve.kernels import isa, reference
from kvserve.kernels.cpu_ext import build_failure, load_cpu_kernels

OP_NAMES = ("rms_norm", "add_rms_norm_", "silu_and_mul", "rope_and_cache_", "paged_attention_",
            "flash_attention_", "flash_attention_supported", "quantize_per_token",
            "dequantize_int32", "argmax_rows", "int4_linear", "int4_linear_fast", "int8_linear",
            "bf16_linear")


def get_ops(use_cpu_kernels: bool = True, level: str | None = None) -> SimpleNamespace:
    """The op set, with `.compiled` telling whether it is the C++ one and `.isa` the level it was
    built for ("torch" for the reference ops)."""
    module: ModuleType | None = load_cpu_kernels(level) if use_cpu_kernels else None
    source = module if module is not None else reference
    ops = SimpleNamespace(**{name: getattr(source, name) for name in OP_NAMES})
    ops.compiled = module is not None
    ops.isa = module.isa if module is not None else "torch"
    return ops


__all__ = ["OP_NAMES", "build_failure", "get_ops", "isa", "load_cpu_kernels"]
