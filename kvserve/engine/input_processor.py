"""Input processing, once for every caller (server, LLM, CLI): chat templates, tokenizing and
the checks that need the model, so a bad request is an InvalidRequestError before it reaches
the engine core."""

from __future__ import annotations

from typing import Any, Sequence

from kvserve.errors import ContextLengthExceededError, InvalidRequestError
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 processor_classes: Sequence[type] = ()):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.processor_classes = processor_classes  # custom logits processors: their args

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None, **template_kwargs: Any) -> dict:
        """A conversation as a prompt: the chat template's text and its token ids."""
        return self.tokenizer.chat_prompt(messages, add_generation_prompt, chat_template,
                                          **template_kwargs)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'",
                                      param="prompt")
        if isinstance(prompt, (list, tuple)):
            return None, self._token_ids(prompt)
        raise InvalidRequestError("a prompt is a string, a list of token ids, or a dict",
                                  param="prompt")

    @staticmethod
    def _token_ids(values) -> list[int]:
        if not isinstance(values, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in values):
            raise InvalidRequestError("prompt token ids must be a list of integers",
                                      param="prompt")
        return list(values)

    def _check_prompt_ids(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary "
                                      f"[0, {vocab})", param="prompt")

    def validate_pooling(self, prompt_ids: list[int]) -> None:
        """A pooling request's prompt: in the vocabulary, and within the context (which it
        may fill: nothing is generated after it)."""
        self._check_prompt_ids(prompt_ids)
        if len(prompt_ids) > self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context is "
                f"{self.max_model_len} tokens", param="input")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Checks needing the model (vocabulary, context length); fills the params' stop token
        set (its own plus the model's EOS); returns the effective max_tokens."""
        self._check_prompt_ids(prompt_ids)
        vocab = self.vocab_size
        params.validate_for_vocab(vocab)
        for processor in self.processor_classes:
            try:
                processor.validate_params(params)
            except ValueError as exc:
                raise InvalidRequestError(f"extra_args: {exc}", param="extra_args") from exc
        if params.top_k >= vocab:  # keeps every token: the same as no top-k (and fits int64)
            params.top_k = 0
        params.all_stop_token_ids = set(params.stop_token_ids)
        if self.tokenizer.eos_token_id is not None:
            params.all_stop_token_ids.add(self.tokenizer.eos_token_id)
        spec = params.structured_outputs
        if spec is not None and spec.key is None:  # the server's async path checked it
            from kvserve.structured_output.compiler import validate

            validate(spec)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context is "
                f"{self.max_model_len} tokens, leaving no room for output", param="prompt")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ContextLengthExceededError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the maximum context of {self.max_model_len} tokens", param="max_tokens")
        return params.max_tokens
