"""Request schemas of the OpenAI API (plus vLLM's extras), validated with pydantic at the edge.

Every violation becomes a 400 with an OpenAI-style body before anything reaches the engine. An
unknown field is one (the client must not believe a feature applied when it did not), and so
is a known field the server does not implement yet (tools) unless its value asks for nothing;
harmless metadata (user, metadata, store, ...) is accepted.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    SamplingParams,
    StructuredOutputsParams,
)

# chat_template_kwargs may not override what the server itself passes to the template
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "chat_template"})


def _check_unicode(data: Any) -> None:
    """JSON can carry lone surrogates ("\\ud800"), which are not text: the tokenizer and the
    UTF-8 response encoder cannot take them. Walks the raw body without recursion."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("strings must be valid Unicode text; lone surrogate escapes "
                                 "such as \\ud800 are not allowed") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# fields the server does not implement yet -> the values that ask for nothing (None always does)
_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),  # OpenAI's deprecated forms of tools and tool_choice
    "function_call": ("none",),
}
LEGACY_FUNCTION_FIELDS = ("functions", "function_call")
# OpenAI's rule for function names
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


def refuse_not_implemented(table: dict[str, tuple[Any, ...]]):
    """A field validator for the fields of `table` (field -> the values that ask for nothing;
    None always does): any other value is a 400 that names the field."""

    def check(value: Any, info: ValidationInfo) -> Any:
        field = info.field_name
        if value is None or value in table[field]:
            return value
        harmless = " or ".join(json.dumps(v) for v in table[field])
        raise PydanticCustomError(
            "not_implemented", "{field} is not supported by this server yet; remove it from "
            "the request" + (f" (or send {harmless}, which asks for nothing)" if harmless
                             else ""), {"field": field})

    return check


class RequestBody(BaseModel):
    """Base of every request body: unknown fields are refused, strings must be real text."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; deltas are not padded


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema. `strict` or not, the output follows the schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format, and the `{"type": "json_object", "schema": {...}}` form
    llama.cpp's server and several hosted APIs accept (instructor's JSON mode on those
    providers sends it): a json_object with a schema follows the schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format.json_schema is needed with type "json_schema", '
                             "and only with it")
        if self.schema_ is not None and self.type != "json_object":
            raise ValueError('response_format.schema goes with type "json_object" (type '
                             '"json_schema" carries its schema in json_schema.schema)')
        return self

    def constraint(self) -> dict[str, Any] | None:
        """StructuredOutputsParams' arguments for this format (None: free text)."""
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        if self.type == "json_object":
            return {"json": self.schema_} if self.schema_ is not None else {"json_object": True}
        return None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False


class _SamplingFields(RequestBody):

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    # prefix-cache isolation (vLLM's field): blocks are shared only between requests that
    # send the same salt
    cache_salt: str | None = Field(None, min_length=1)
    # agent sessions: the request's KV is kept for the session's next turn (kvserve's field;
    # else OpenAI's prompt_cache_key, else user, names the session)
    session_id: str | None = Field(None, min_length=1)
    prompt_cache_key: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # each prompt token's logprob and this many alternatives (vLLM's field): the choice's (a
    # chat response's) `prompt_logprobs`
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # disaggregated prefill/decode (vLLM's field): {"do_remote_decode": true} to a prefill
    # engine; the handle it answers with, to a decode engine
    kv_transfer_params: dict[str, Any] | None = None
    # arguments for custom logits processors (vLLM's field): SamplingParams.extra_args
    vllm_xargs: dict[str, Any] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (one of them per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def session(self) -> str | None:
        """The agent session this request belongs to, if it names one."""
        return self.session_id or self.prompt_cache_key or self.user or None

    def kv_params(self):
        from kvserve.protocol.kv_transfer_params import parse_kv_transfer_params

        return parse_kv_transfer_params(self.kv_transfer_params)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value):
        if value is None:
            return value
        for key in value:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            extra_args=self.vllm_xargs,
            structured_outputs=self.structured_spec(),
        )

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The one constraint the request's structured-output fields ask for, if any."""
        given = {field: value for field, value in self._structured_fields().items()
                 if value is not None}
        if len(given) > 1:
            raise InvalidRequestError(f"{' and '.join(given)} both constrain the output; send "
                                      "one of them", param=next(iter(given)))
        if not given:
            return None
        field, spec = next(iter(given.items()))
        try:
            return StructuredOutputsParams(**spec)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{field}: {exc}", param=field) from exc

    def structured_field(self) -> str:
        """The request field that carries the constraint (for errors that name it)."""
        return next((field for field, value in self._structured_fields().items()
                     if value is not None), "structured_outputs")

    def _structured_fields(self) -> dict[str, dict[str, Any] | None]:
        """Each structured-output field as StructuredOutputsParams' arguments (None: unset)."""
        formats = self.response_format.constraint() if self.response_format else None
        body = self.structured_outputs
        structured = None
        if body is not None:
            structured = body.model_dump(by_alias=True, exclude_defaults=True)
            if isinstance(structured.get("structural_tag"), dict):
                structured["structural_tag"] = json.dumps(structured["structural_tag"])
            structured["disable_any_whitespace"] = body.disable_any_whitespace
        guided = {"guided_json": ("json", self.guided_json),
                  "guided_regex": ("regex", self.guided_regex),
                  "guided_choice": ("choice", self.guided_choice),
                  "guided_grammar": ("grammar", self.guided_grammar)}
        return {"response_format": formats, "structured_outputs": structured,
                **{field: {kind: value} if value is not None else None
                   for field, (kind, value) in guided.items()}}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0: score the prompt without generating (echo + logprobs, or prompt_logprobs)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0: the engine runs the prompt and samples one token nobody is shown."""
        return self.max_tokens == 0

    def engine_params(self) -> SamplingParams:
        """The engine's sampling parameters: echoed logprobs score the prompt too."""
        params = self.sampling_params(1 if self.prompt_only else self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = max(params.prompt_logprobs or 0, self.logprobs)
        return params

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)

    def check_unsupported(self) -> None:
        if self.prompt_only and not self.echo and self.prompt_logprobs is None:
            raise InvalidRequestError("max_tokens 0 returns nothing: it scores the prompt "
                                      "with echo and logprobs, or prompt_logprobs",
                                      param="max_tokens")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls follow the parameters schema either way


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history (as the API returned it)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call
    # an assistant turn's reasoning sent back, as the server returned it
    reasoning_content: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:  # under the keys templates read: Qwen3's, gpt-oss's
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning models' effort; the chat template reads it (gpt-oss's harmony system
    # message), as chat_template_kwargs' reasoning_effort
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's, with --reasoning-parser: the reasoning in the reply (false: the answer alone),
    # and at most this many tokens of thinking before its close is forced
    include_reasoning: bool = True
    thinking_token_budget: int | None = Field(None, ge=0)
    # OpenAI's metadata and hints that change nothing here: accepted
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # tool calling (OpenAI's); the deprecated functions / function_call are not implemented
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None

    _legacy_functions = field_validator(*LEGACY_FUNCTION_FIELDS)(
        refuse_not_implemented(_NOT_IMPLEMENTED))

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_an_offered_tool(cls, choice, info: ValidationInfo):
        tools = info.data.get("tools") or []
        if choice is not None and choice != "none" and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                tool.function.name for tool in tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among "
                             "the tools")
        return choice

    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" when tools are offered, "none" otherwise."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the model may call (none with tool_choice "none")."""
        if not self.tools or self.effective_tool_choice() == "none":
            return []
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_kwargs(cls, value):
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(value or {}))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs=true",
                                          param="top_logprobs")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
