"""/v1/completions and /v1/chat/completions: validate, prepare through the engine's input
processor, then stream or collect (`serving` shapes the responses)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvserve.engine.async_engine import AsyncEngine
from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.entrypoints.openai.routes.context import (
    check_ready_and_model,
    config_of,
    engine_of,
    model_name,
)
from kvserve.errors import InvalidRequestError

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return problem
    body.check_unsupported()
    engine = engine_of(raw)
    response_id = serving.new_id("cmpl")
    params = body.sampling_params(body.max_tokens, body.logprobs)
    await _compile_grammar(engine, body, params)
    prompts = body.prompts()
    kv_params = body.kv_params()
    if kv_params is not None and len(prompts) != 1:
        raise InvalidRequestError("kv_transfer_params needs a single prompt", param="prompt")
    prepared = [_prepare(engine, f"{response_id}-{i}", p, params, body.priority, kv_params)
                for i, p in enumerate(prompts)]
    echo = [p.prompt if p.prompt is not None else engine.detokenize(p.prompt_token_ids)
            for p in prepared] if body.echo else []
    job = serving.make_job("completion", response_id, body, model_name(raw), prepared, echo,
                           not config_of(raw).disable_log_requests, body.logprobs or 0)
    return await _run(job, body, raw, engine)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request):
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return problem
    engine = engine_of(raw)
    num_top = body.requested_logprobs()
    params = body.sampling_params(body.requested_max_tokens(), num_top)
    await _compile_grammar(engine, body, params)
    prompt = engine.inputs.render_chat([m.as_template_message() for m in body.messages],
                                       body.add_generation_prompt,
                                       **(body.chat_template_kwargs or {}))
    response_id = serving.new_id("chatcmpl")
    prepared = [_prepare(engine, response_id, prompt, params, body.priority, body.kv_params())]
    job = serving.make_job("chat", response_id, body, model_name(raw), prepared, [],
                           not config_of(raw).disable_log_requests, num_top or 0)
    return await _run(job, body, raw, engine)


async def _compile_grammar(engine: AsyncEngine, body, params) -> None:
    """The request's grammar, compiled off the event loop; a grammar that cannot be used is a
    400 naming the field that carried it."""
    try:
        await engine.compile_grammar(params)
    except InvalidRequestError as exc:
        field = body.structured_field()
        raise InvalidRequestError(f"{field}: {exc}", param=field) from exc


def _prepare(engine: AsyncEngine, *args):
    """`engine.prepare`, with an error in the processors' arguments named by the HTTP field
    that carried them (vllm_xargs)."""
    try:
        return engine.prepare(*args)
    except InvalidRequestError as exc:
        if exc.param != "extra_args":
            raise
        raise InvalidRequestError(str(exc).replace("extra_args", "vllm_xargs", 1),
                                  param="vllm_xargs") from exc


async def _run(job, body, raw: Request, engine: AsyncEngine):
    if job.log_requests:
        serving.logger.info("%s received: %d prompt(s), %d prompt tokens, n=%d, stream=%s",
                            job.response_id, len(job.prepared),
                            sum(len(p.prompt_token_ids) for p in job.prepared), job.n,
                            body.stream)
    if body.stream:
        return serving.sse_response(serving.stream_job(engine, job, body.include_usage))
    started = time.monotonic()
    try:
        outputs = await serving.collect(engine, job, raw)
    except serving.ClientDisconnected:
        serving.logger.info("%s aborted: client disconnected", job.response_id)
        return Response(status_code=499)
    serving.log_finish(job, outputs, started)
    if job.kind == "chat":
        return serving.json_response(serving.chat_response(job, outputs))
    return serving.json_response(serving.completion_response(job, outputs))
