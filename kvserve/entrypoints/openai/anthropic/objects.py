"""Messages API objects: the message (its content blocks, why it stopped, its usage), and the
pieces of it a stream sends in message_start and message_delta."""

from __future__ import annotations

from typing import Any

from kvserve.entrypoints.openai.anthropic.blocks import ContentBlocks
from kvserve.entrypoints.openai.serving import Job
from kvserve.outputs import CompletionOutput, RequestOutput


def message(job: Job, output: RequestOutput) -> dict[str, Any]:
    """The whole answer as a message object."""
    sample = output.outputs[0]
    blocks = content_blocks(job)
    content = blocks.whole(sample.text)
    return {**shell(job), "content": content,
            **stop_fields(job, sample, blocks.called), "usage": usage(output)}


def content_blocks(job: Job) -> ContentBlocks:
    """The job's answer as blocks: its tools' format, harmony, its thinking (shown unless
    the request disabled it)."""
    return ContentBlocks(job.tool_format, job.harmony, job.reasoning, job.include_reasoning)


def shell(job: Job) -> dict[str, Any]:
    """The message before any output (message_start's): the whole prompt counted as input
    until the engine says how much of it the prefix cache held."""
    return {"id": job.response_id, "type": "message", "role": "assistant", "model": job.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(job.prepared[0].prompt_token_ids), "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def stop_fields(job: Job, sample: CompletionOutput, called: bool) -> dict[str, Any]:
    """stop_reason and stop_sequence: a stop string is stop_sequence (and names it); a call
    that ended the turn tool_use; a cut at max_tokens max_tokens, or
    model_context_window_exceeded when the context ended it first; else end_turn."""
    reason, sequence = "end_turn", None
    if sample.finish_reason == "length":
        requested = job.prepared[0].params.max_tokens
        reason = ("model_context_window_exceeded"
                  if requested is not None and len(sample.token_ids) < requested
                  else "max_tokens")
    elif called:
        reason = "tool_use"
    elif isinstance(sample.stop_reason, str):
        reason, sequence = "stop_sequence", sample.stop_reason
    return {"stop_reason": reason, "stop_sequence": sequence}


def usage(output: RequestOutput) -> dict[str, Any]:
    """Anthropic's split of the prompt: input_tokens are those computed, cache reads those the
    prefix cache held (their sum is the prompt, /v1/messages/count_tokens' count)."""
    cached = output.num_cached_tokens
    return {"input_tokens": len(output.prompt_token_ids) - cached,
            "output_tokens": sum(len(sample.token_ids) for sample in output.outputs),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
