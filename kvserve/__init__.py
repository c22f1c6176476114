"""kvserve: a high-performance LLM inference engine and OpenAI-compatible server on PyTorch.

The package's face imports lazily: `import kvserve.router` (or `kvserve.bench`) loads neither
torch nor the engine, so a router process stays small; `kvserve.LLM` loads them on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvserve.entrypoints.llm",
    "CompletionOutput": "kvserve.outputs",
    "RequestOutput": "kvserve.outputs",
    "SamplingParams": "kvserve.sampling_params",
    "RequestOutputKind": "kvserve.sampling_params",
    "LoRARequest": "kvserve.lora_request",
}

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "RequestOutputKind",
           "SamplingParams", "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
