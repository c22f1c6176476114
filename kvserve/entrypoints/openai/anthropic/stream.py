"""A streamed message as Anthropic's events, in Anthropic's order: message_start; per content
block content_block_start, content_block_delta... (thinking_delta then one signature_delta
for a thinking block, text_delta for text, input_json_delta for a tool_use block),
content_block_stop, with a ping after the first block opens; message_delta (stop_reason,
stop_sequence, usage); message_stop. An engine failure midway ends the stream with an `error`
event instead."""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator

from kvserve.engine.async_engine import AsyncEngine
from kvserve.entrypoints.openai.anthropic.errors import exception_body
from kvserve.entrypoints.openai.anthropic.objects import (
    content_blocks,
    shell,
    stop_fields,
    usage,
)
from kvserve.entrypoints.openai.serving import Job, merged_stream
from kvserve.sampling_params import RequestOutputKind

logger = logging.getLogger("kvserve.requests")

PING = {"type": "ping"}


def frame(event: dict[str, Any]) -> str:
    """One SSE frame, named by the event's type (as Anthropic sends them)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def message_events(engine: AsyncEngine, job: Job) -> AsyncIterator[str]:
    yield frame({"type": "message_start", "message": shell(job)})
    blocks = content_blocks(job)
    pinged = False
    try:
        result = None
        # whole replies: the parsers look back over the text each step
        async for _, result in merged_stream(engine, job, RequestOutputKind.CUMULATIVE):
            sample = result.outputs[0]
            for event in blocks.feed(sample.text, sample.finish_reason is not None):
                yield frame(event)
                if not pinged:  # the first event opens the first block
                    pinged = True
                    yield frame(PING)
        for event in blocks.close():
            yield frame(event)
        if not pinged:
            yield frame(PING)
        sample = result.outputs[0]
        yield frame({"type": "message_delta", "delta": stop_fields(job, sample, blocks.called),
                     "usage": usage(result)})
        yield frame({"type": "message_stop"})
    except Exception as exc:  # engine failure mid-stream: tell the client, then end
        logger.warning("stream %s failed: %s", job.response_id, exc)
        yield frame(exception_body(exc)[1])
