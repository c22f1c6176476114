"""/tokenize and /detokenize (vLLM's extra routes): the same template and tokenizer the
generation routes use, so a client can count a prompt's tokens exactly."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.entrypoints.openai.routes.context import check_ready_and_model, engine_of
from kvserve.errors import InvalidRequestError

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request):
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return problem
    inputs = engine_of(raw).inputs
    if body.messages is not None:
        tokens = inputs.render_chat([m.as_template_message() for m in body.messages],
                                    body.add_generation_prompt)["prompt_token_ids"]
    elif body.prompt is not None:
        tokens = inputs.tokenizer.encode(body.prompt, body.add_special_tokens)
    else:
        raise InvalidRequestError("give 'prompt' or 'messages'", param="prompt")
    return {"tokens": tokens, "count": len(tokens), "max_model_len": inputs.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request):
    problem = check_ready_and_model(raw, body.model)
    if problem:
        return problem
    return {"prompt": engine_of(raw).detokenize(body.tokens)}
