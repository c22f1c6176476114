"""/v1/responses: OpenAI's Responses API, served by the chat path. The request becomes a chat
request (earlier turns from the store first), `generation.prepare_chat_job` prepares it as it
prepares /v1/chat/completions, and the outputs become a response object or its events
(`entrypoints/openai/responses/`)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.errors import error_response
from kvserve.entrypoints.openai.responses.conversation import chat_messages
from kvserve.entrypoints.openai.responses.objects import Turn, new_id, output_items
from kvserve.entrypoints.openai.responses.protocol import InputItem, ResponsesRequest
from kvserve.entrypoints.openai.responses.store import ResponseStore
from kvserve.entrypoints.openai.responses.stream import response_events
from kvserve.entrypoints.openai.routes.context import check_ready_and_model, engine_of
from kvserve.entrypoints.openai.routes.generation import prepare_chat_job
from kvserve.errors import InvalidRequestError

router = APIRouter()

# the chat fields an error from the chat path may name -> the Responses field that carried it
_PARAMS = {"response_format": "text", "max_completion_tokens": "max_output_tokens",
           "reasoning_effort": "reasoning",
           "max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}
_WORDS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
          "max_tokens": "max_output_tokens"}


def store_of(raw: Request) -> ResponseStore:
    return raw.app.state.responses


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request):
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return problem
    history = _history(store_of(raw), body.previous_response_id)
    if history is None:
        return _not_found(body.previous_response_id, "previous_response_id")
    conversation = history + body.input_items()
    response_id = new_id("resp")
    job = await _prepare(body, conversation, raw, response_id)
    turn = Turn(body, response_id, job.model, job.created, conversation)
    serving.log_received(job, body.stream)
    if body.stream:
        return serving.sse_response(response_events(engine_of(raw), job, turn, store_of(raw)))
    started = time.monotonic()
    try:
        outputs = await serving.collect(engine_of(raw), job, raw)
    except serving.ClientDisconnected:
        serving.logger.info("%s aborted: client disconnected", response_id)
        return Response(status_code=499)
    serving.log_finish(job, outputs, started)
    response = turn.finished(output_items(outputs[0].outputs[0], job.tool_format, job.harmony,
                                          job.reasoning), outputs[0])
    store_of(raw).keep(turn, response)
    return JSONResponse(response)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw: Request, stream: bool = False):
    if stream:
        return error_response(400, "streaming a stored response again is not supported",
                              "stream", "invalid_request")
    stored = store_of(raw).get(response_id)
    if stored is None:
        return _not_found(response_id, "response_id")
    return JSONResponse(stored.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw: Request):
    if not store_of(raw).delete(response_id):
        return _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _history(store: ResponseStore, previous_response_id: str | None) -> list[InputItem] | None:
    """The conversation before this request: the stored one it continues (None: not stored,
    never or no longer), or nothing."""
    if previous_response_id is None:
        return []
    stored = store.get(previous_response_id)
    return None if stored is None else list(stored.conversation)


def _not_found(response_id: str, param: str) -> JSONResponse:
    return error_response(404, f"Response with id {response_id!r} not found (never stored, "
                          "stored with store: false, deleted, or evicted from this server's "
                          "--max-stored-responses)", param, "not_found")


async def _prepare(body: ResponsesRequest, conversation: list[InputItem], raw: Request,
                   response_id: str) -> serving.Job:
    """The chat path's job for this request; its errors name the Responses fields."""
    chat = body.chat_request(chat_messages(body.instructions, conversation))
    try:
        job = await prepare_chat_job(chat, raw, response_id)
    except InvalidRequestError as exc:
        message = str(exc)
        for chat_word, word in _WORDS.items():
            message = message.replace(chat_word, word)
        raise type(exc)(message, param=_PARAMS.get(exc.param, exc.param)) from exc
    return job
