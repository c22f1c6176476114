"""Typed errors raised by kvserve.

Every error a user can cause or fix carries a message that says what went wrong and what to do.
The HTTP layer maps these to OpenAI-style error bodies; library users catch them by type.
"""


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class ModelNotFoundError(KVServeError):
    """The model reference resolved to nothing usable."""


class UnsupportedArchitectureError(KVServeError):
    """The checkpoint is a model family kvserve does not implement."""


class UnsupportedQuantizationError(KVServeError):
    """A tensor is stored in a quantized format kvserve cannot read."""


class UnsupportedTokenizerError(KVServeError):
    """The checkpoint describes a tokenizer kvserve cannot build."""


class CorruptModelFileError(KVServeError):
    """A model file exists but cannot be parsed or is missing required parts."""


class InsufficientMemoryError(KVServeError):
    """The model's weights or its KV cache cannot fit in the memory this machine (or its cgroup)
    has available; refused at load, before an OOM kill would end the process."""


class KernelBuildError(KVServeError):
    """The compiled C++ CPU kernels were asked for and cannot be built or loaded here (no
    compiler, a broken one, a level this CPU cannot execute). KVSERVE_KERNELS=reference or
    --no-cpu-kernels runs the torch reference ops instead."""


class InvalidRequestError(KVServeError, ValueError):
    """A request's parameters are invalid; nothing was scheduled."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class LoRANotFoundError(InvalidRequestError):
    """A request or an unload names a LoRA adapter that is not loaded (HTTP 404)."""


class ContextLengthExceededError(InvalidRequestError):
    """The prompt plus the requested output does not fit the model's context."""


class EngineDeadError(KVServeError):
    """The engine failed to start or stopped (its core process died, or the server is
    shutting down); requests cannot be served until it is back."""


class RequestFailedError(KVServeError):
    """The engine raised while running this request; other requests go on."""
