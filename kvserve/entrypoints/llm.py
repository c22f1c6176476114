"""The offline API, compatible with vLLM's: `from kvserve import LLM, SamplingParams`."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from tqdm import tqdm

from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.engine_config import EngineConfig
from kvserve.entrypoints.pooling import PoolingMixin
from kvserve.lora_request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM(PoolingMixin):
    """Load a model once, then `generate` or `chat` over many prompts in continuous batches
    (or, with `runner="pooling"`, `embed`, `encode` and `score` them: entrypoints/pooling.py)."""

    def __init__(self, model: str | None = None, **options: Any):
        known = {f.name for f in dataclasses.fields(EngineConfig)} | {"override_pooler_config"}
        unknown = set(options) - known
        if unknown:
            raise TypeError(f"unknown LLM options: {', '.join(sorted(unknown))}")
        if model is not None:
            options["model"] = model
        if "override_pooler_config" in options:  # vLLM's older name
            options["pooler_config"] = options.pop("override_pooler_config")
        self.llm_engine = LLMEngine(EngineConfig(**options))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine core (its process, when it has one). Also happens when the LLM is
        garbage-collected or the interpreter exits."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.
        `lora_request`: the adapter every prompt runs, or one per prompt (None: the base);
        an adapter not loaded yet is loaded first (needs `enable_lora=True`)."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else \
            [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        request_ids = []
        try:
            for index, prompt in enumerate(prompts):
                request_id = str(next(self._ids))
                self.llm_engine.add_request(request_id, prompt, params[index],
                                            priority=priority[index] if priority else 0,
                                            lora_request=loras[index])
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        inputs = self.llm_engine.inputs
        prompts = [inputs.render_chat(list(conversation), add_generation_prompt, chat_template)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        """One copy a prompt, FINAL_ONLY: generate() returns finished outputs only, so no
        step builds the others (as vLLM's LLM does)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError("give one SamplingParams, or one per prompt")
        copies = [p.clone() for p in sampling_params]
        for params in copies:
            params.output_kind = RequestOutputKind.FINAL_ONLY
        return copies

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Generating", unit="req",
                        disable=not use_tqdm)
        with progress:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
                failures = engine.take_failures()
                if failures:  # the others of this call are dropped with it
                    engine.abort_request(request_ids)
                    raise failures[0][1]
        return [finished[request_id] for request_id in request_ids]
