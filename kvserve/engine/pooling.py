"""The front-end's side of pooling requests (--runner pooling): which runner serves which
request, and each pooling request's PoolingParams completed from the model's pooler config
(config/pooler.py) and checked, so a bad one is an InvalidRequestError before the core sees it.

A pooling request enters the core like any other, with a SamplingParams that never samples:
it finishes when its prompt is computed, its pooled vector on its only output.
"""

from __future__ import annotations

from kvserve.config.pooler import PoolerConfig, resolve_pooler_config
from kvserve.engine_config import EngineConfig
from kvserve.errors import InvalidRequestError
from kvserve.model_source import ModelSource
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.weights import load_config


class PoolingInputs:
    """What the runner serves, and the model's pooler config when it pools."""

    def __init__(self, config: EngineConfig, source: ModelSource):
        self.runner = "pooling" if config.runner == "pooling" else "generate"
        self.pooler: PoolerConfig | None = None
        self.hidden_size = 0
        if self.runner == "pooling":  # a checkpoint it cannot pool fails at start-up
            self.pooler = resolve_pooler_config(source.path if source.format == "hf" else None,
                                                config.pooler_config)
            self.hidden_size = load_config(source).hidden_size

    @property
    def pools(self) -> bool:
        return self.pooler is not None

    def check_generate(self) -> None:
        """A generate request on a pooling runner is refused (vLLM's answer)."""
        if self.pools:
            raise InvalidRequestError(
                "this model is served with --runner pooling: it answers /v1/embeddings, "
                "/pooling, /score and /rerank, not generation", param="model")

    def params(self, requested: PoolingParams | None) -> PoolingParams:
        """A copy of the request's PoolingParams completed from the pooler config (pooling
        type, normalize and dimensions by default) and checked against the model."""
        pooler = self.pooler
        if pooler is None:
            raise InvalidRequestError(
                "this model is served with --runner generate: start it with --runner pooling "
                "to serve embeddings, scores and reranking", param="model")
        params = (requested or PoolingParams()).clone()
        if params.dimensions is not None and not pooler.allows_dimensions:
            raise InvalidRequestError("this model does not support Matryoshka dimensions "
                                      "(its config says is_matryoshka: false)",
                                      param="dimensions")
        if params.dimensions is None:
            params.dimensions = pooler.dimensions
        params.verify(pooler.pooling_type, pooler.normalize, self.hidden_size,
                      list(pooler.matryoshka_dimensions))
        return params


def pooling_sampling_params() -> SamplingParams:
    """The SamplingParams a pooling request carries through the core: it never samples, and
    its caller reads only its final output."""
    return SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
