"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served by the chat
path. The request becomes a chat request, `generation.prepare_chat_job` prepares it as it
prepares /v1/chat/completions, and the outputs become a message or its events
(`entrypoints/openai/anthropic/`). Errors here are Anthropic-shaped (`AnthropicRoute`)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.anthropic.errors import AnthropicRoute, reshaped
from kvserve.entrypoints.openai.anthropic.objects import message
from kvserve.entrypoints.openai.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvserve.entrypoints.openai.anthropic.stream import message_events
from kvserve.entrypoints.openai.anthropic.thinking import check_server_thinks
from kvserve.entrypoints.openai.reasoning.parser import uses_harmony
from kvserve.entrypoints.openai.responses.objects import new_id
from kvserve.entrypoints.openai.routes.context import (
    check_ready_and_model,
    config_of,
    engine_of,
)
from kvserve.entrypoints.openai.routes.generation import prepare_chat_job
from kvserve.errors import InvalidRequestError

router = APIRouter(route_class=AnthropicRoute)

# the chat fields an error from the chat path may name -> the Messages API's
_FIELDS = {"response_format": "output_config.format", "reasoning_effort": "output_config.effort",
           "max_completion_tokens": "max_tokens",
           "thinking_token_budget": "thinking.budget_tokens"}


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, raw: Request):
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return reshaped(problem)
    job = await _prepare(body, raw, new_id("msg"))
    serving.log_received(job, body.stream)
    if body.stream:
        return serving.sse_response(message_events(engine_of(raw), job))
    started = time.monotonic()
    try:
        outputs = await serving.collect(engine_of(raw), job, raw)
    except serving.ClientDisconnected:
        serving.logger.info("%s aborted: client disconnected", job.response_id)
        return Response(status_code=499)
    serving.log_finish(job, outputs, started)
    return JSONResponse(message(job, outputs[0]))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, raw: Request):
    """The prompt /v1/messages would run, tools included, counted: the same preparation,
    never sent to the engine."""
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return reshaped(problem)
    job = await _prepare(body, raw, new_id("count"))
    return {"input_tokens": len(job.prepared[0].prompt_token_ids)}


async def _prepare(body: CountTokensRequest | MessagesRequest, raw: Request,
                   message_id: str) -> serving.Job:
    """The chat path's job for this request; its errors name the Messages API's fields."""
    parser = config_of(raw).reasoning_parser
    check_server_thinks(body.thinking, parser is not None or uses_harmony(
        parser, engine_of(raw).inputs.tokenizer.chat_template))
    try:
        return await prepare_chat_job(body.chat_request(), raw, message_id)
    except InvalidRequestError as exc:
        message = str(exc)
        for chat_field, field in _FIELDS.items():
            message = message.replace(chat_field, field)
        if message == str(exc):
            raise
        raise InvalidRequestError(message, param=_FIELDS.get(exc.param, exc.param)) from exc
