"""The prompt's token ids as a replica will see them: the served model's tokenizer and chat
template applied exactly as the server applies them (entrypoints/openai/server.py), so the
router's block hashes are the replica's. A body the router cannot read gives None: it is routed
by load alone and the replica answers it (with its own 400, if it is bad)."""

from __future__ import annotations

import logging

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class PromptTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model: str) -> "PromptTokenizer":
        from kvserve.model_source import resolve_model
        from kvserve.tokenizer import load_tokenizer

        return cls(load_tokenizer(resolve_model(model)))

    def token_ids(self, path: str, body) -> list[int] | None:
        """The first prompt's token ids (a completion with several prompts is placed by its
        first), or None."""
        if not isinstance(body, dict):
            return None
        try:
            if path == CHAT_PATH:
                request = ChatCompletionRequest.model_validate(body)
                return self.tokenizer.chat_prompt(
                    [m.as_template_message() for m in request.messages],
                    request.add_generation_prompt,
                    **(request.chat_template_kwargs or {}))["prompt_token_ids"]
            prompt = CompletionRequest.model_validate(body).prompts()[0]
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            return [int(t) for t in prompt]
        except Exception as exc:  # invalid: the replica says why
            logger.debug("cannot tokenize a %s body: %s", path, exc)
            return None


def cache_salt_of(payload) -> str | None:
    """The request's `cache_salt`: replicas hash its blocks under it, so must the router.
    (Per-tenant salts of a multi-key replica are not known here: such requests route by
    load.)"""
    salt = payload.get("cache_salt") if isinstance(payload, dict) else None
    return salt if isinstance(salt, str) and salt else None
