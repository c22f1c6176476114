"""How projections hold and multiply their weights: the methods chosen when a model is built
(float, our int4/int8/w4a8/w8a8 conversions) and the quantized layers they run.

Names are imported on first use (PEP 562): `kvserve.quant.modes` is read without torch."""

from kvserve.quant.modes import QUANTIZATION_MODES, check_quantization_device

_LAZY = {
    "resolve_quantization": "kvserve.quant.linear",
    "ConvertMethod": "kvserve.quant.methods",
    "FloatMethod": "kvserve.quant.methods",
    "LinearMethod": "kvserve.quant.methods",
    "QuantPolicy": "kvserve.quant.policy",
}

__all__ = ["QUANTIZATION_MODES", "check_quantization_device", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
