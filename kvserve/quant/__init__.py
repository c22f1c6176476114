"""How projections hold and multiply their weights: the methods chosen when a model is built
(float, our int4/int8/w4a8/w8a8 conversions) and the quantized layers they run."""

from kvserve.quant.linear import (
    QUANTIZATION_MODES,
    check_quantization_device,
    resolve_quantization,
)
from kvserve.quant.methods import ConvertMethod, FloatMethod, LinearMethod
from kvserve.quant.policy import QuantPolicy

__all__ = ["QUANTIZATION_MODES", "ConvertMethod", "FloatMethod", "LinearMethod", "QuantPolicy",
           "check_quantization_device", "resolve_quantization"]
