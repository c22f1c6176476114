"""The offline pooling API of `LLM(..., runner="pooling")`, as vLLM's: `encode` (each prompt's
pooled vector as a tensor), `embed` (as a list of floats) and `score` (pairs of texts scored by
the cosine similarity of their embeddings)."""

from __future__ import annotations

from typing import Sequence

from kvserve.engine.llm_engine import PromptType
from kvserve.entrypoints.scoring import cosine, score_pairs
from kvserve.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvserve.pooling_params import PoolingParams


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or a prompt dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class PoolingMixin:
    """LLM's pooling methods (they need `llm_engine`, `_ids` and `_run` of LLM)."""

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, pooling_task: str | None = None
               ) -> list[PoolingRequestOutput]:
        """Each prompt's pooled vector (`outputs.data`, a float32 tensor), in prompt order."""
        prompts = as_prompt_list(prompts)
        params = pooling_params if isinstance(pooling_params, (list, tuple)) else \
            [pooling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one PoolingParams, or one per prompt")
        request_ids = []
        try:
            for prompt, param in zip(prompts, params):
                param = (param or PoolingParams()).clone()
                param.task = pooling_task or param.task or "encode"
                request_id = str(next(self._ids))
                self.llm_engine.add_pooling_request(request_id, prompt, param)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`, a list of floats)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def score(self, data_1: PromptType | Sequence[PromptType],
              data_2: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's pairing (one against one, one against many, or two equal lists pairwise),
        each pair scored by the cosine similarity of its embeddings (`outputs.score`)."""
        firsts, seconds = as_prompt_list(data_1), as_prompt_list(data_2)
        pairs = score_pairs(list(range(len(firsts))), list(range(len(seconds))), int)
        params = (pooling_params or PoolingParams()).clone()
        params.task = "score"
        encoded = self.encode(firsts + seconds, params, use_tqdm)
        return [ScoringRequestOutput(
            f"{encoded[i].request_id}_{encoded[len(firsts) + j].request_id}",
            ScoringOutput(cosine(encoded[i].outputs.values,
                                 encoded[len(firsts) + j].outputs.values)),
            encoded[i].prompt_token_ids + encoded[len(firsts) + j].prompt_token_ids)
            for i, j in pairs]
