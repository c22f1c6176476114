"""Quantized linear layers (int4/int8 weight-only, W8A8) and the pass that swaps them in."""

from kvserve.quant.linear import (
    QUANTIZATION_MODES,
    check_quantization_device,
    quantize_model,
    resolve_quantization,
    use_bf16_panels,
)

__all__ = ["QUANTIZATION_MODES", "check_quantization_device", "quantize_model",
           "resolve_quantization", "use_bf16_panels"]
