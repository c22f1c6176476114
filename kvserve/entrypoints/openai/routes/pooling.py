"""The pooling routes (--runner pooling): /v1/embeddings (OpenAI's), /pooling and /score (vLLM's),
/rerank and /v1/rerank (Jina's and Cohere's shape). Each input is one pooling request; a
request's inputs run together in the engine's batches, and a client that leaves aborts them.
On a generate runner every route answers 400 (`AsyncEngine.prepare_pooling` refuses)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_engine import AsyncEngine
from kvserve.entrypoints.openai.disconnect import until_disconnected
from kvserve.entrypoints.openai.pooling.protocol import (
    EmbeddingRequest,
    PoolingInputRequest,
    PoolingRequest,
    Prompt,
    RerankRequest,
    ScoreRequest,
)
from kvserve.entrypoints.openai.pooling.responses import (
    new_id,
    rerank_response,
    score_response,
    vectors_response,
)
from kvserve.entrypoints.openai.routes.context import check_ready_and_model, engine_of, model_name
from kvserve.entrypoints.scoring import cosine, score_pairs
from kvserve.errors import InvalidRequestError
from kvserve.outputs import PoolingRequestOutput
from kvserve.pooling_params import PoolingParams

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request):
    return await _vectors("embedding", body, raw, "embed")


@router.post("/pooling")
async def pooling(body: PoolingRequest, raw: Request):
    return await _vectors("pooling", body, raw, "encode")


async def _vectors(kind: str, body: PoolingInputRequest, raw: Request, task: str):
    problem = _check(raw, body.model)
    if problem:
        return problem
    engine = engine_of(raw)
    prompts = [_prompt(engine, prompt, body.add_special_tokens) for prompt in body.prompts()]
    outputs = await _pool(engine, raw, prompts, body.pooling_params(task), body.priority)
    if outputs is None:
        return Response(status_code=499)
    return JSONResponse(vectors_response(kind, model_name(raw), outputs, body.encoding_format))


@router.post("/score")
async def score(body: ScoreRequest, raw: Request):
    problem = _check(raw, body.model)
    if problem:
        return problem
    pairs = score_pairs(*body.sides(), str)
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))  # each embedded once
    outputs = await _pool(engine_of(raw), raw, texts, PoolingParams(task="score"),
                          body.priority)
    if outputs is None:
        return Response(status_code=499)
    vectors = {text: output.outputs.values for text, output in zip(texts, outputs)}
    scores = [cosine(vectors[first], vectors[second]) for first, second in pairs]
    return JSONResponse(score_response(model_name(raw), scores, outputs))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, raw: Request):
    problem = _check(raw, body.model)
    if problem:
        return problem
    documents = body.texts()
    outputs = await _pool(engine_of(raw), raw, [body.query, *documents],
                          PoolingParams(task="score"), body.priority)
    if outputs is None:
        return Response(status_code=499)
    query = outputs[0].outputs.values
    scores = [cosine(query, output.outputs.values) for output in outputs[1:]]
    return JSONResponse(rerank_response(model_name(raw), documents, scores, body.top_n,
                                        body.return_documents, outputs))


def _check(raw: Request, requested: str | None):
    """The route's error response (not ready, another model), or None; a LoRA adapter's name
    is a 400: pooling requests run the base model."""
    problem = check_ready_and_model(raw, requested)
    if problem is None and requested and requested not in (model_name(raw),
                                                           engine_of(raw).config.model):
        raise InvalidRequestError("pooling requests run the base model: LoRA adapters are "
                                  "not served for them yet", param="model")
    return problem


def _prompt(engine: AsyncEngine, prompt: Prompt, add_special_tokens: bool):
    """A text tokenized without special tokens when the request says so (vLLM's
    add_special_tokens); otherwise as the engine tokenizes it."""
    if isinstance(prompt, str) and not add_special_tokens:
        return {"prompt": prompt,
                "prompt_token_ids": engine.inputs.tokenizer.encode(prompt, False)}
    return prompt


async def _pool(engine: AsyncEngine, raw: Request, prompts: list, params: PoolingParams,
                priority: int) -> list[PoolingRequestOutput] | None:
    """Every prompt's pooled output, in order (None: the client left, and they were aborted).
    All are validated before any runs; one that fails aborts the others."""
    request_id = new_id("pool")
    prepared = [engine.prepare_pooling(f"{request_id}-{index}", prompt, params, priority)
                for index, prompt in enumerate(prompts)]

    async def final(one) -> PoolingRequestOutput:
        async for output in engine.generate(one):
            if output.finished:
                return output
        raise RuntimeError("the request ended without its output")

    async def run_all() -> list[PoolingRequestOutput]:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(final(one)) for one in prepared]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return [task.result() for task in tasks]

    return await until_disconnected(raw, run_all())
