"""Quantization modes by name, and which devices run them: what a config checks before any
model code is imported (the API front-end does without torch)."""

from __future__ import annotations

# plus "auto", see linear.resolve_quantization
QUANTIZATION_MODES = ("none", "int4", "int8", "w8a8", "w4a8", "gguf", "fp8")

# How a checkpoint may store float weights: a GGUF's float types, an HF directory's dtypes
FLOAT_SOURCE_TYPES = ("F32", "F16", "BF16", "float32", "float16", "bfloat16")

# Modes whose weights live in torch's CPU-only int4 packing (`_weight_int4pack_mm_for_cpu`) or
# our C++ kernels: they run on CPU models only.
CPU_ONLY_MODES = ("int4", "w4a8", "gguf", "fp8")


def device_type(device: str) -> str:
    """"cuda" for "cuda:1", as torch.device(device).type, without importing torch."""
    return str(device).partition(":")[0]


def check_quantization_device(mode: str, device: str) -> None:
    """ValueError for a mode the device cannot run (the 4-bit modes off the CPU)."""
    if mode in CPU_ONLY_MODES and device_type(device) != "cpu":
        raise ValueError(f"quantization {mode!r} runs on the CPU only (its int4 kernels are "
                         f"CPU kernels), not on {device!r}; use int8, w8a8 or none there")
