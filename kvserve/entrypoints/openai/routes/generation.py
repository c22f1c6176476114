"""/v1/completions and /v1/chat/completions: validate, prepare through the engine's input
processor, then stream or collect (`serving` shapes the responses)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvserve.engine.async_engine import AsyncEngine
from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.harmony import turn_end_token_ids
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.entrypoints.openai.reasoning.grammar import after_thinking, thinking_markers
from kvserve.entrypoints.openai.reasoning.parser import (
    THINK_TAG_PARSERS,
    ThinkingPlan,
    thinking_plan,
    uses_harmony,
)
from kvserve.entrypoints.openai.routes.context import (
    cache_salt,
    check_ready_and_model,
    config_of,
    engine_of,
    lora_of,
    served_name,
)
from kvserve.entrypoints.openai.tools.formats import choose_format, template_takes_tools
from kvserve.entrypoints.openai.tools.grammar import harmony_call_tag, tool_structural_tag
from kvserve.entrypoints.openai.tools.prompt import for_template, template_messages
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return problem
    body.check_unsupported()
    engine = engine_of(raw)
    response_id = serving.new_id("cmpl")
    params = body.engine_params()
    await _validate_grammar(engine, body, params)
    prompts = body.prompts()
    kv_params = body.kv_params()
    if kv_params is not None and len(prompts) != 1:
        raise InvalidRequestError("kv_transfer_params needs a single prompt", param="prompt")
    salt = cache_salt(raw, body.cache_salt)
    lora = lora_of(raw, body.model)
    prepared = [_prepare(engine, f"{response_id}-{i}", p, params, body.priority, kv_params,
                         salt, body.session(), lora) for i, p in enumerate(prompts)]
    echo = [p.prompt if p.prompt is not None else engine.detokenize(p.prompt_token_ids)
            for p in prepared] if body.echo else []
    job = serving.make_job("completion", response_id, body, served_name(raw, lora), prepared,
                           echo,
                           not config_of(raw).disable_log_requests, body.logprobs or 0)
    if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs lead them
        job.echo_first_tokens = [engine.inputs.tokenizer.decode(p.prompt_token_ids[:1], False)
                                 for p in prepared]
    return await _run(job, body, raw, engine)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request):
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return problem
    job = await prepare_chat_job(body, raw, serving.new_id("chatcmpl"))
    return await _run(job, body, raw, engine_of(raw))


async def prepare_chat_job(body: ChatCompletionRequest, raw: Request,
                           response_id: str) -> serving.Job:
    """A chat request made ready to run: sampling, tools, grammar, the rendered prompt. Also the
    path /v1/responses takes (it translates its request into a chat one), so both APIs render,
    constrain and validate alike."""
    engine = engine_of(raw)
    num_top = body.requested_logprobs()
    params = body.sampling_params(body.requested_max_tokens(), num_top)
    messages = [m.as_template_message() for m in body.messages]
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        template_kwargs["reasoning_effort"] = body.reasoning_effort
    tool_format, grammar_field = None, None  # grammar_field: where a tools grammar came from
    parser = config_of(raw).reasoning_parser
    harmony = uses_harmony(parser, engine.inputs.tokenizer.chat_template)
    if harmony:  # its channels are special tokens: the reply is read with them
        params.skip_special_tokens = False
        params.stop_token_ids = [*(params.stop_token_ids or ()), *turn_end_token_ids(
            engine.inputs.tokenizer)]
        messages, extra, constrained = _harmony_tools(body, messages, config_of(raw), params)
        template_kwargs.update(extra)
        grammar_field = "tools" if constrained else None
    elif body.offered_tools():
        tool_format, messages, extra = await _plan_tools(engine, body, config_of(raw), params,
                                                         messages)
        template_kwargs.update(extra)
        grammar_field = "tools"
    await _validate_grammar(engine, body, params, grammar_field)
    prompt = engine.inputs.render_chat(messages, body.add_generation_prompt, **template_kwargs)
    plan = None if harmony else thinking_plan(parser, prompt["prompt"], template_kwargs)
    await _plan_thinking(engine, body, params, plan, parser, grammar_field)
    lora = lora_of(raw, body.model)
    prepared = [_prepare(engine, response_id, prompt, params, body.priority, body.kv_params(),
                         cache_salt(raw, body.cache_salt), body.session(), lora)]
    job = serving.make_job("chat", response_id, body, served_name(raw, lora), prepared, [],
                           not config_of(raw).disable_log_requests, num_top or 0)
    job.tool_format = tool_format
    job.harmony = harmony
    job.reasoning = plan
    job.include_reasoning = body.include_reasoning
    return job


async def _plan_thinking(engine: AsyncEngine, body: ChatCompletionRequest, params,
                         plan: ThinkingPlan | None, parser: str | None,
                         grammar_field: str | None) -> None:
    """A thinking reply's constraints: its grammar moved after the thinking, its thinking
    budget, and its markers kept in the text where the tokenizer calls them special."""
    if body.thinking_token_budget is not None and parser not in THINK_TAG_PARSERS:
        raise InvalidRequestError("thinking_token_budget needs a server started with "
                                  "--reasoning-parser deepseek_r1 or qwen3",
                                  param="thinking_token_budget")
    if plan is None:  # no thinking in this reply: nothing to move, count or keep
        return
    tokenizer = engine.inputs.tokenizer
    markers = thinking_markers(tokenizer, plan)
    if set(markers.start_token_ids + markers.end_token_ids) & tokenizer.all_special_ids:
        params.skip_special_tokens = False
    if body.thinking_token_budget is not None:
        params.thinking_token_budget, params.thinking = body.thinking_token_budget, markers
    if params.structured_outputs is None:
        return
    field = grammar_field or body.structured_field()
    try:  # xgrammar builds the grammar: off the event loop
        params.structured_outputs = await asyncio.to_thread(
            after_thinking, params.structured_outputs, plan)
    except Exception as exc:
        raise InvalidRequestError(f"{field} cannot follow the thinking: {exc}",
                                  param=field) from exc
    await _validate_grammar(engine, body, params, field)


def _harmony_tools(body: ChatCompletionRequest, messages: list[dict], config, params):
    """(messages, template variables, whether the tools constrain the output) for a harmony
    model: its template renders the tools itself and the reply's channels say what is a call.
    With "auto" nothing constrains the output; "required" or a named function constrain
    `params` to reasoning, then a call."""
    tools = body.offered_tools()
    if not tools:
        return messages, {}, False
    choice = body.effective_tool_choice()
    if choice == "auto" and not config.enable_auto_tool_choice:
        raise InvalidRequestError('tool_choice "auto" needs a server started with '
                                  "--enable-auto-tool-choice", param="tool_choice")
    constrained = choice != "auto"
    if constrained:
        _check_tools_alone(body, params)
        params.structured_outputs = StructuredOutputsParams(
            structural_tag=harmony_call_tag(tools, choice))
    return [for_template(m) for m in messages], {"tools": tools}, constrained


def _check_tools_alone(body: ChatCompletionRequest, params) -> None:
    """A 400 where the tools' grammar would meet another constraint on where output ends."""
    if params.structured_outputs is not None:
        raise InvalidRequestError(f"tools and {body.structured_field()} both constrain the "
                                  "output; send one of them", param="tools")
    if params.min_tokens:  # as with any grammar: it decides where the output ends
        raise InvalidRequestError("min_tokens cannot be combined with tools",
                                  param="min_tokens")


async def _plan_tools(engine: AsyncEngine, body: ChatCompletionRequest, config, params,
                      messages: list[dict]):
    """(the model's tool format, the messages and template variables that describe the tools,
    ) with `params` constrained to calls that parse; a 400 for what cannot be combined."""
    choice = body.effective_tool_choice()
    if choice == "auto" and not config.enable_auto_tool_choice:
        raise InvalidRequestError('tool_choice "auto" needs a server started with '
                                  "--enable-auto-tool-choice", param="tool_choice")
    _check_tools_alone(body, params)
    template = engine.inputs.tokenizer.chat_template
    tool_format = choose_format(config.tool_call_parser, template)
    tools = body.offered_tools()
    # xgrammar's first import takes seconds: off the event loop
    tag = await asyncio.to_thread(tool_structural_tag, tools, choice,
                                  body.parallel_tool_calls is not False, tool_format)
    params.structured_outputs = StructuredOutputsParams(structural_tag=tag)
    messages, extra = template_messages(messages, tools, tool_format,
                                        template_takes_tools(template))
    return tool_format, messages, extra


async def _validate_grammar(engine: AsyncEngine, body, params, field: str | None = None) -> None:
    """The request's grammar, checked off the event loop; a grammar that cannot be used is a
    400 naming the field that carried it."""
    try:
        await engine.validate_grammar(params)
    except InvalidRequestError as exc:
        field = field or body.structured_field()
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
    serving.log_received(job, body.stream)
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
