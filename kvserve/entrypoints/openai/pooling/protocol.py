"""Request schemas of the pooling routes, validated at the edge like every other body (unknown
fields are a 400 naming them): OpenAI's embeddings request, vLLM's /pooling and /score, and
the Jina/Cohere rerank request vLLM serves."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.entrypoints.openai.protocol import RequestBody
from kvserve.errors import InvalidRequestError
from kvserve.pooling_params import PoolingParams

MAX_INPUTS = 2048  # OpenAI's limit of inputs in one embeddings request
# /score's pairs of sides, as vLLM names them (one pair per request)
SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
               ("data_1", "data_2"))

Prompt = str | list[int]


class PoolingInputRequest(RequestBody):
    """What /v1/embeddings and /pooling share: inputs as a string, a list of strings, token
    ids or a list of token-id lists."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: int = 0

    def prompts(self) -> list[Prompt]:
        """Each input as a text or its token ids; an empty one is a 400."""
        value = self.input
        if isinstance(value, str) or (value and all(isinstance(v, int) for v in value)):
            prompts = [value]
        else:
            prompts = list(value)
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise InvalidRequestError("input must not be empty (nor hold an empty string or "
                                      "token list)", param="input")
        if len(prompts) > MAX_INPUTS:
            raise InvalidRequestError(f"at most {MAX_INPUTS} inputs in one request",
                                      param="input")
        return prompts

    def pooling_params(self, task: str) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize, task=task)


class EmbeddingRequest(PoolingInputRequest):
    """OpenAI's POST /v1/embeddings."""


class PoolingRequest(PoolingInputRequest):
    """vLLM's POST /pooling: the pooler's raw output per input (here the same vector)."""


class ScoreRequest(RequestBody):
    """vLLM's POST /score: one pair of sides (text_1/text_2, queries/documents, queries/items
    or data_1/data_2), each a text or a list of texts."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    priority: int = 0
    user: str | None = None

    @model_validator(mode="after")
    def _one_pair(self):
        given = [pair for pair in SCORE_SIDES if getattr(self, pair[0]) is not None
                 and getattr(self, pair[1]) is not None]
        named = {name for name in (n for pair in SCORE_SIDES for n in pair)
                 if getattr(self, name) is not None}
        if len(given) != 1 or named != set(given[0]):
            raise ValueError("give exactly one pair of sides: text_1 and text_2, queries and "
                             "documents, queries and items, or data_1 and data_2")
        return self

    def sides(self) -> tuple[str | list[str], str | list[str]]:
        first, second = next(pair for pair in SCORE_SIDES if getattr(self, pair[0]) is not None
                             and getattr(self, pair[1]) is not None)
        return getattr(self, first), getattr(self, second)


class RerankDocument(BaseModel):
    """A document given as an object (Jina's and Cohere's form)."""

    model_config = ConfigDict(extra="forbid")
    text: str


class RerankRequest(RequestBody):
    """POST /rerank and /v1/rerank (Jina's and Cohere's shape, as vLLM serves it): the documents
    ordered by their relevance to the query, the best `top_n` (0: all)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int = Field(0, ge=0)
    return_documents: bool = True
    priority: int = 0
    user: str | None = None

    def texts(self) -> list[str]:
        texts = [d if isinstance(d, str) else d.text for d in self.documents]
        if not self.query or not texts or any(not text for text in texts):
            raise InvalidRequestError("query and documents must not be empty",
                                      param="documents" if self.query else "query")
        if len(texts) > MAX_INPUTS:
            raise InvalidRequestError(f"at most {MAX_INPUTS} documents in one request",
                                      param="documents")
        return texts
