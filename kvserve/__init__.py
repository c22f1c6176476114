"""kvserve: a high-performance LLM inference engine and OpenAI-compatible server on PyTorch."""

__version__ = "0.1.0"

from kvserve.entrypoints.llm import LLM  # noqa: E402
from kvserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
