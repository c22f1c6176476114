"""Completions and chat completions: requests -> engine streams -> OpenAI JSON or SSE.

Each prompt (times n samples) is one engine request; their outputs are merged into choices. A
non-streaming request watches its client and aborts on disconnect; a streaming one aborts when
the response generator is closed. Either way the abort happens in AsyncEngine.generate.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.llm_engine import PreparedRequest
from kvserve.entrypoints.openai.errors import engine_error_body
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.entrypoints.openai.tools.formats import ToolFormat
from kvserve.entrypoints.openai.harmony import StreamingHarmonyParser, parse_reply
from kvserve.entrypoints.openai.reasoning.parser import (
    ReasoningStream,
    ThinkingPlan,
    split_reasoning,
)
from kvserve.entrypoints.openai.tools.parser import StreamingToolParser, parse_tool_calls
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind

logger = logging.getLogger("kvserve.requests")

DISCONNECT_POLL_SECONDS = 0.2


class ClientDisconnected(Exception):
    pass


@dataclass
class ChoiceCursor:
    """What has been streamed of one choice so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False  # a chunk went out (a completion's echo rides on the first)
    token_text_offset: int = 0  # a completion's next logprob text_offset
    finished: bool = False
    deltas: bool = False  # the outputs carry only what is new (RequestOutputKind.DELTA)
    # when the request offered tools, the model speaks harmony (its channels) or thinks
    tools: StreamingToolParser | StreamingHarmonyParser | ReasoningStream | None = None
    # the request's output that carried its prompt logprobs (they ride on the first chunk)
    prompt: RequestOutput | None = None


@dataclass
class Job:
    """One HTTP request: its engine requests, and how choices map onto them."""

    kind: str  # "completion" | "chat"
    response_id: str
    model: str
    created: int
    prepared: list[PreparedRequest]
    n: int
    echo_texts: list[str] = field(default_factory=list)
    log_requests: bool = True
    num_top: int = 0  # top logprobs per token asked for
    tool_format: ToolFormat | None = None  # the model's tool-call format, when tools were offered
    harmony: bool = False  # gpt-oss: the reply's channels are reasoning, calls and content
    reasoning: ThinkingPlan | None = None  # --reasoning-parser: the reply thinks, then answers
    include_reasoning: bool = True  # the reasoning goes out (vLLM's include_reasoning)
    prompt_only: bool = False  # max_tokens 0: the one token the engine samples is not shown
    show_prompt_logprobs: bool = False  # the request's prompt_logprobs: vLLM's field answers
    # echo with logprobs: each prompt's first token's text (it has no logprob); the prompt's
    # logprobs lead the choice's
    echo_first_tokens: list[str] = field(default_factory=list)

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.n + sample_index


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- running jobs ------------------------------------------------------------------------
async def merged_stream(engine: AsyncEngine, job: Job, output_kind: RequestOutputKind
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all of the job's engine requests as they come, tagged by prompt index. One
    request (the usual case) is read directly: no pump task and queue hop per token."""
    if len(job.prepared) == 1:
        async with contextlib.aclosing(engine.generate(job.prepared[0],
                                                       output_kind)) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, prepared: PreparedRequest):
        try:
            async for output in engine.generate(prepared, output_kind):
                await queue.put((index, output))
        except BaseException as exc:  # forwarded to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(job.prepared)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(engine: AsyncEngine, job: Job, raw: Request) -> list[RequestOutput]:
    """Run to completion, aborting everything if the client disconnects meanwhile."""
    finals: dict[int, RequestOutput] = {}

    async def consume():
        async for index, output in merged_stream(engine, job, RequestOutputKind.FINAL_ONLY):
            if output.finished:
                finals[index] = output

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await raw.is_disconnected():
                raise ClientDisconnected()
        task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return [finals[i] for i in range(len(job.prepared))]


# ---- formatting ----------------------------------------------------------------------------
def usage(outputs: list[RequestOutput], completion_tokens: int | None = None
          ) -> dict[str, Any]:
    """The usage block of finished outputs; `completion_tokens` counted by the caller where the
    outputs were deltas."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(o.num_cached_tokens for o in outputs),
            # prompt tokens whose KV a prefill engine computed (disaggregated serving)
            "transferred_tokens": sum(o.num_transferred_tokens for o in outputs)},
    }
    drafted = sum(c.num_draft_tokens for o in outputs for c in o.outputs)
    if drafted:  # speculative decoding, in OpenAI's predicted-outputs fields
        accepted = sum(c.num_accepted_tokens for o in outputs for c in o.outputs)
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": drafted - accepted}
    return body


def _completion_logprobs(choice: CompletionOutput, start: int, text_offset: int,
                         num_top: int) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(choice.token_ids[start:], choice.logprobs[start:]):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        top_logprobs.append(_top_by_text(entry, num_top))
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _top_by_text(entry: dict[int, Any], num_top: int) -> dict[str, float] | None:
    """The legacy completions shape of a token's alternatives: text -> logprob."""
    if not num_top:
        return None
    return {lp.decoded_token: lp.logprob for lp in entry.values()
            if lp.rank is not None and lp.rank <= num_top}


def _chat_logprobs(choice: CompletionOutput, start: int, num_top: int) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(choice.token_ids[start:], choice.logprobs[start:]):
        chosen = entry[token_id]
        top = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        content.append({
            "token": chosen.decoded_token,
            "logprob": chosen.logprob,
            "bytes": list((chosen.decoded_token or "").encode()),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                              "bytes": list((lp.decoded_token or "").encode())}
                             for _, lp in top if lp.rank is not None and lp.rank <= num_top][
                                 :num_top],
        })
    return {"content": content}


def completion_response(job: Job, outputs: list[RequestOutput]) -> dict[str, Any]:
    choices = []
    for prompt_index, output in enumerate(outputs):
        echo = job.echo_texts[prompt_index] if job.echo_texts else ""
        for sample in output.outputs:
            sample = _without_hidden_token(job, sample)
            choice = {
                "index": job.choice_index(prompt_index, sample.index),
                "text": echo + sample.text,
                "logprobs": _joined(_echo_logprobs(job, prompt_index, output),
                                    _completion_logprobs(sample, 0, len(echo), job.num_top)),
                "finish_reason": sample.finish_reason,
                "stop_reason": sample.stop_reason,
            }
            if job.show_prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
            choices.append(choice)
    return _with_kv_handle({"id": job.response_id, "object": "text_completion",
                            "created": job.created, "model": job.model, "choices": choices,
                            "usage": usage(outputs, 0 if job.prompt_only else None)}, outputs)


def _without_hidden_token(job: Job, sample: CompletionOutput) -> CompletionOutput:
    """The sample as the client sees it: with max_tokens 0, nothing of the one token the
    engine sampled to finish the prompt."""
    if not job.prompt_only:
        return sample
    return dataclasses.replace(sample, text="", token_ids=[],
                               logprobs=None if sample.logprobs is None else [])


def _echo_logprobs(job: Job, prompt_index: int, output: RequestOutput) -> dict[str, Any] | None:
    """The echoed prompt's tokens in the completions logprobs shape: the first has no logprob
    (nothing comes before it), each other one its logprob after the tokens before it."""
    if not job.echo_first_tokens or output.prompt_logprobs is None:
        return None
    tokens, token_logprobs = [job.echo_first_tokens[prompt_index]], [None]
    top_logprobs: list[dict[str, float] | None] = [None]
    for token_id, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        top_logprobs.append(_top_by_text(entry, job.num_top))
    offsets = list(itertools.accumulate((len(t or "") for t in tokens[:-1]), initial=0))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _joined(first: dict[str, Any] | None, second: dict[str, Any] | None
            ) -> dict[str, Any] | None:
    """Two runs of completions logprobs, one after the other (the echoed prompt's, the
    sample's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs_body(prompt_logprobs: list | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, None for the first, else each scored
    token id's logprob, rank and text."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {
        str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token_id, lp in entry.items()} for entry in prompt_logprobs]


def chat_response(job: Job, outputs: list[RequestOutput]) -> dict[str, Any]:
    choices = [{
        "index": sample.index,
        **_chat_message(job, sample),
        "logprobs": _chat_logprobs(sample, 0, job.num_top),
        "stop_reason": sample.stop_reason,
    } for sample in outputs[0].outputs]
    body = {"id": job.response_id, "object": "chat.completion", "created": job.created,
            "model": job.model, "choices": choices, "usage": usage(outputs)}
    if job.show_prompt_logprobs:  # vLLM puts a chat answer's at the top level
        body["prompt_logprobs"] = prompt_logprobs_body(outputs[0].prompt_logprobs)
    return _with_kv_handle(body, outputs)


def _chat_message(job: Job, sample: CompletionOutput) -> dict[str, Any]:
    """The choice's message and finish reason: its text, or with tools its calls (and the text
    around them, None when there is none)."""
    if job.harmony:
        return _harmony_message(job, sample)
    reasoning, answer = None, sample.text
    if job.reasoning is not None:
        reasoning, answer = split_reasoning(sample.text, job.reasoning)
    if job.tool_format is None:
        content = answer if job.reasoning is None else answer or None
        return {"message": _message(job, content, reasoning),
                "finish_reason": sample.finish_reason}
    parsed = parse_tool_calls(answer or "", job.tool_format)
    message = _message(job, parsed.content.strip() or None, reasoning)
    if parsed.calls:
        message["tool_calls"] = parsed.calls
    return {"message": message,
            "finish_reason": _tool_finish_reason(sample, bool(parsed.calls))}


def _message(job: Job, content: str | None, reasoning: str | None) -> dict[str, Any]:
    """An assistant message; with a reasoning model, its reasoning under vLLM's names: the
    older `reasoning_content` and the newer `reasoning`."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if job.harmony or job.reasoning is not None:
        shown = reasoning if job.include_reasoning else None
        message["reasoning_content"] = message["reasoning"] = shown
    return message


def _harmony_message(job: Job, sample: CompletionOutput) -> dict[str, Any]:
    reply = parse_reply(sample.text)
    message = _message(job, reply.content, reply.reasoning_content)
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return {"message": message,
            "finish_reason": _tool_finish_reason(sample, bool(reply.tool_calls))}


def _stream_parser(job: Job
                   ) -> StreamingToolParser | StreamingHarmonyParser | ReasoningStream | None:
    if job.harmony:
        return StreamingHarmonyParser()
    tools = StreamingToolParser(job.tool_format) if job.tool_format else None
    return ReasoningStream(job.reasoning, tools) if job.reasoning is not None else tools


def _shown(job: Job, delta: dict[str, Any]) -> dict[str, Any] | None:
    """A parser's delta as it goes out: reasoning under both of vLLM's names (or not at all
    without include_reasoning)."""
    if "reasoning_content" not in delta:
        return delta
    if not job.include_reasoning:
        return None
    return {**delta, "reasoning": delta["reasoning_content"]}


def _with_kv_handle(body: dict[str, Any], outputs: list[RequestOutput]) -> dict[str, Any]:
    """A prefill engine's answer carries the handle a decode engine pulls the KV with, at the
    top level as vLLM puts it."""
    handle = next((o.kv_transfer_params for o in outputs if o.kv_transfer_params), None)
    if handle is not None:
        body["kv_transfer_params"] = handle.to_json()
    return body


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def stream_job(engine: AsyncEngine, job: Job, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: text deltas per choice, a final chunk per choice, usage, then [DONE]. Plain
    text streams from the engine's deltas; a reply a tool or harmony parser reads is taken whole
    each step (the parsers look back over it)."""
    cursors: dict[int, ChoiceCursor] = {}
    parsed = _stream_parser(job) is not None
    kind = RequestOutputKind.CUMULATIVE if parsed else RequestOutputKind.DELTA
    finals: dict[int, RequestOutput] = {}
    chunk_object = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    base = {"id": job.response_id, "object": chunk_object, "created": job.created,
            "model": job.model}
    try:
        if job.kind == "chat":
            for index in range(job.n):
                yield _sse({**base, "choices": [{"index": index, "delta": {
                    "role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}]})
        async for prompt_index, output in merged_stream(engine, job, kind):
            if output.finished:
                finals[prompt_index] = output
            for sample in output.outputs:
                index = job.choice_index(prompt_index, sample.index)
                cursor = cursors.get(index)
                if cursor is None:
                    cursor = cursors[index] = ChoiceCursor(tools=_stream_parser(job),
                                                           deltas=not parsed)
                if output.prompt_logprobs is not None:
                    cursor.prompt = output
                for chunk in _delta_chunks(job, prompt_index, sample, cursor):
                    yield _sse({**base, "choices": [chunk]})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage(
                [finals[i] for i in range(len(job.prepared))],
                sum(cursor.tokens_sent for cursor in cursors.values()))})
        yield _sse("[DONE]")
    except Exception as exc:  # engine failure mid-stream: tell the client, then end
        logger.warning("stream %s failed: %s", job.response_id, exc)
        yield _sse(engine_error_body(exc)[1])
        yield _sse("[DONE]")


def _delta_chunks(job: Job, prompt_index: int, sample: CompletionOutput,
                  cursor: ChoiceCursor) -> list[dict[str, Any]]:
    """This output's chunks for one choice: one, or with tools, one per delta the tool parser
    gives (content, each call's name, its arguments), the new tokens' logprobs on the first
    (an empty delta when the parser holds their text back), the finish reason on the last."""
    if cursor.tools is None:
        chunk = _delta_chunk(job, prompt_index, sample, cursor)
        return [chunk] if chunk is not None else []
    if cursor.finished:
        return []
    index = job.choice_index(prompt_index, sample.index)
    finished = sample.finish_reason is not None
    shown = (_shown(job, delta) for delta in cursor.tools.feed(sample.text, finished))
    chunks = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
              for delta in shown if delta is not None]
    logprobs = _chat_logprobs(sample, cursor.tokens_sent, job.num_top)
    if logprobs is not None and logprobs["content"]:  # the new tokens', on the first chunk
        if not chunks:  # the parser holds their text back (a call may be starting)
            chunks.append({"index": index, "delta": {}, "finish_reason": None})
        chunks[0]["logprobs"] = logprobs
    cursor.text_sent, cursor.tokens_sent = len(sample.text), len(sample.token_ids)
    if finished:
        cursor.finished = True
        chunks.append({"index": index, "delta": {}, "logprobs": None,
                       "finish_reason": _tool_finish_reason(sample, cursor.tools.called),
                       "stop_reason": sample.stop_reason})
    return chunks


def _tool_finish_reason(sample: CompletionOutput, called: bool) -> str | None:
    return "tool_calls" if called and sample.finish_reason == "stop" else sample.finish_reason


def _delta_chunk(job: Job, prompt_index: int, sample: CompletionOutput,
                 cursor: ChoiceCursor) -> dict[str, Any] | None:
    """One chunk of this output's new text and tokens (all of a DELTA output; past the cursor
    of a cumulative one), or None when it has nothing to say. The first carries the echoed
    prompt and the prompt's logprobs."""
    if cursor.finished:
        return None
    sample = _without_hidden_token(job, sample)
    if cursor.deltas:
        text, token_start = sample.text, 0
    else:
        text, token_start = sample.text[cursor.text_sent:], cursor.tokens_sent
    new_tokens = len(sample.token_ids) - token_start
    text_delta = text
    echo = job.echo_texts[prompt_index] if job.kind == "completion" and job.echo_texts else ""
    if echo and not cursor.started:
        text_delta = echo + text
    if not text_delta and not sample.finish_reason and new_tokens == 0:
        return None
    index = job.choice_index(prompt_index, sample.index)
    if job.kind == "chat":
        logprobs = _chat_logprobs(sample, token_start, job.num_top)
        chunk = {"index": index, "delta": {"content": text_delta} if text_delta else {},
                 "logprobs": logprobs}
    else:
        # offsets go on from the previous chunk's, after the echoed prompt (as returned whole)
        start = cursor.token_text_offset if cursor.started else len(echo)
        logprobs = _completion_logprobs(sample, token_start, start, job.num_top)
        if logprobs is not None:
            cursor.token_text_offset = start + sum(len(t or "") for t in logprobs["tokens"])
        if not cursor.started and cursor.prompt is not None:
            logprobs = _joined(_echo_logprobs(job, prompt_index, cursor.prompt), logprobs)
        chunk = {"index": index, "text": text_delta, "logprobs": logprobs}
    if not cursor.started and job.show_prompt_logprobs:
        chunk["prompt_logprobs"] = prompt_logprobs_body(
            cursor.prompt.prompt_logprobs if cursor.prompt is not None else None)
    chunk["finish_reason"] = sample.finish_reason
    chunk["stop_reason"] = sample.stop_reason
    cursor.started = True
    cursor.text_sent += len(text)
    cursor.tokens_sent += new_tokens
    cursor.finished = sample.finish_reason is not None
    return chunk


def sse_response(generator: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(generator, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def json_response(payload: dict[str, Any]) -> JSONResponse:
    return JSONResponse(payload)


def log_received(job: Job, stream: bool) -> None:
    if job.log_requests:
        logger.info("%s received: %d prompt(s), %d prompt tokens, n=%d, stream=%s",
                    job.response_id, len(job.prepared),
                    sum(len(p.prompt_token_ids) for p in job.prepared), job.n, stream)


def log_finish(job: Job, outputs: list[RequestOutput], started: float) -> None:
    if job.log_requests:
        reasons = [c.finish_reason for o in outputs for c in o.outputs]
        logger.info("%s finished in %.3fs: %s, usage %s", job.response_id,
                    time.monotonic() - started, reasons, usage(outputs))


def make_job(kind: str, response_id: str, request: CompletionRequest | ChatCompletionRequest,
             model: str, prepared: list[PreparedRequest], echo_texts: list[str],
             log_requests: bool, num_top: int) -> Job:
    return Job(kind=kind, response_id=response_id, model=model, created=int(time.time()),
               prepared=prepared, n=request.n, echo_texts=echo_texts, log_requests=log_requests,
               num_top=num_top, prompt_only=getattr(request, "prompt_only", False),
               show_prompt_logprobs=request.prompt_logprobs is not None)
