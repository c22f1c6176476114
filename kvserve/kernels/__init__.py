"""Fused per-layer ops for decoder steps: the compiled C++ CPU kernels, or the torch reference
versions with the same signatures when those are asked for. `get_ops(True)` is what the engine
uses by default (the build for `isa.selected_level()`); `get_ops(True, level)` forces one level;
`compiled_ops(level)` is that level's build whatever the environment says (the tests run every
level the machine can execute); `get_ops(False)` (`--no-cpu-kernels`) runs the plain torch ops.

`KVSERVE_KERNELS` chooses for the whole process (and the engine's core and worker processes,
which inherit it): `compiled` (the default) or `reference` (the torch ops, e.g. on a machine
without a C++ compiler). Compiled kernels that were asked for and do not build are a
`KernelBuildError`, never a silent switch to the reference ops."""

from __future__ import annotations

import os
from types import ModuleType, SimpleNamespace

from kvserve.errors import KernelBuildError
from kvserve.kernels import isa

OP_NAMES = ("rms_norm", "add_rms_norm_", "rms_norm_heads_", "silu_and_mul", "gelu_tanh_and_mul",
            "swigluoai_and_mul",
            "rope_and_cache_", "paged_attention_", "latent_attention_",
            "flash_attention_", "flash_attention_supported", "quantize_per_token",
            "dequantize_int32", "argmax_rows", "top_p_mask_", "draw_rows",
            "apply_token_bitmask_", "int4_linear", "int4_linear_fast", "int8_linear",
            "bf16_linear", "int4_linear_q8", "int8_linear_q8", "q8_dot_wide", "gguf_pack",
            "gguf_dequantize", "gguf_linear_q8", "gguf_linear_q8k", "gguf_linear_int",
            "gguf_superblocks_enabled", "set_gguf_superblocks", "gguf_linear_dequant",
            "lora_add_")
# Compiled-only: the decoder layers as one C++ call (models/decode_stack.py), the fused
# mixture of experts (models/layers/moe.py) and the AMX tiles under gguf_linear_dequant; the
# torch reference op set has none of them, and the model then keeps its Python loops.
COMPILED_ONLY_NAMES = ("DecodeStack", "StackInstruction", "StackLinear", "MoeLayer",
                       "gguf_linear_amx", "gguf_amx_usable", "set_gguf_amx")
KERNELS_ENV = "KVSERVE_KERNELS"
KERNEL_CHOICES = ("compiled", "reference")


def kernels_choice() -> str:
    """`KVSERVE_KERNELS`: "compiled" (unset) or "reference"."""
    choice = os.environ.get(KERNELS_ENV, "").strip().lower() or "compiled"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    return choice


def get_ops(use_cpu_kernels: bool = True, level: str | None = None) -> SimpleNamespace:
    """The op set, with `.compiled` telling whether it is the C++ one and `.isa` the level it was
    built for ("torch" for the reference ops). Raises KernelBuildError when the compiled kernels
    are asked for (`use_cpu_kernels`, and KVSERVE_KERNELS is not `reference`) and do not build."""
    if not use_cpu_kernels or kernels_choice() == "reference":
        from kvserve.kernels import reference  # torch: imported where ops are used, not here

        return _op_set(reference, "torch")
    return compiled_ops(level)


def compiled_ops(level: str | None = None) -> SimpleNamespace:
    """The compiled op set for `level` (default: the selected one); KernelBuildError if it does
    not build or this CPU cannot execute it."""
    from kvserve.kernels.cpu_ext import require_cpu_kernels

    module = require_cpu_kernels(level)
    return _op_set(module, module.isa)


def _op_set(source: ModuleType, level: str) -> SimpleNamespace:
    ops = SimpleNamespace(**{name: getattr(source, name) for name in OP_NAMES})
    for name in COMPILED_ONLY_NAMES:
        if hasattr(source, name):
            setattr(ops, name, getattr(source, name))
    ops.compiled = level != "torch"
    ops.isa = level
    return ops


def __getattr__(name: str):
    """The extension loader's names, imported on first use: it imports torch, which a process
    that only reads `isa` (the API front-end, a benchmark client) does without."""
    if name in ("build_failure", "load_cpu_kernels", "require_cpu_kernels"):
        from kvserve.kernels import cpu_ext

        return getattr(cpu_ext, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KERNELS_ENV", "KernelBuildError", "OP_NAMES", "build_failure", "compiled_ops",
           "get_ops", "isa", "kernels_choice", "load_cpu_kernels"]
