"""The Responses API's request body (POST /v1/responses) and its input items, validated at the
edge like the chat body: an unknown field, a tool type, an input item or a content part the
server does not implement is a 400 naming it, so a client never believes a feature applied.

`chat_request` is the one translation into the chat-completions request the chat route
serves, so both APIs render, constrain and sample alike."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvserve.entrypoints.openai.protocol import (
    FUNCTION_NAME_PATTERN,
    ChatCompletionRequest,
    RequestBody,
    StreamOptions,
    refuse_not_implemented,
)
from kvserve.errors import InvalidRequestError

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PART_TYPES = ("input_text", "output_text")
REASONING_PART_TYPES = ("reasoning_text", "summary_text")
# OpenAI fields the server does not implement -> the values that ask for nothing
_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "include": ([],),
    "truncation": ("disabled",),
    "conversation": (),
    "top_logprobs": (0,),
    "max_tool_calls": (),
    "prompt": (),
    "context_management": ([],),
    "prompt_cache_retention": ("in_memory",),
}


class TextPart(BaseModel):
    """Input text, or an earlier answer's output text sent back (its annotations ignored)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: str


def joined(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(BaseModel):
    # extra fields ignored: an output item sent back as input carries its id and status
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str | list[TextPart]


class ReasoningPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning sent back (a reasoning model's template may render it
    before the calls it led to, as gpt-oss's does); its text is the content's, else the
    summary's."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"] = "reasoning"
    content: list[ReasoningPart] | None = None
    summary: list[ReasoningPart] = []

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


def _not_implemented(message: str) -> PydanticCustomError:
    return PydanticCustomError("not_implemented", message)


def _typed_items(items: Any) -> Any:
    """The input list with `type` filled in on bare messages ({"role", "content"}); an item
    type or content part the server does not implement is refused by name."""
    if not isinstance(items, list):
        return items
    typed = []
    for index, item in enumerate(items):
        if isinstance(item, dict):
            item = {"type": "message", **item} if "type" not in item and "role" in item \
                else item
            _check_item(index, item)
        typed.append(item)
    return typed


def _check_item(index: int, item: dict[str, Any]) -> None:
    kind = item.get("type")
    if kind not in ITEM_TYPES:
        raise _not_implemented(f"input[{index}]: items of type {kind!r} are not supported by "
                               f"this server; send {', '.join(ITEM_TYPES)} items")
    if kind == "reasoning":  # other shapes than lists: the model's validation says so
        parts = [part for key in ("content", "summary") for part in _listed(item.get(key))]
        allowed = REASONING_PART_TYPES
    else:
        parts = _listed(item.get("content") if kind == "message" else item.get("output"))
        allowed = TEXT_PART_TYPES
    for number, part in enumerate(parts):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type not in allowed:
            raise _not_implemented(
                f"input[{index}]: content parts of type {part_type!r} are not supported by "
                f"this server (part {number}); send {' or '.join(allowed)} parts")


def _listed(value: Any) -> list:
    return value if isinstance(value, list) else []


class FunctionTool(BaseModel):
    """Responses' flat function tool (chat nests the same fields under "function")."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls follow the parameters schema either way

    def as_chat_tool(self) -> dict[str, Any]:
        return {"type": "function",
                "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError('text.format.schema is needed with type "json_schema", and only '
                             "with it")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's response_format for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {
            "name": self.name or "response", "schema": self.schema_,
            **({"description": self.description} if self.description else {}),
            **({"strict": self.strict} if self.strict is not None else {})}}


class ReasoningConfig(BaseModel):
    """`reasoning`: the effort goes to the chat template (gpt-oss's harmony system message
    says it), as chat's reasoning_effort; summaries are not written here."""

    model_config = ConfigDict(extra="forbid")
    effort: Literal["low", "medium", "high"] | None = None
    summary: Any = None
    generate_summary: Any = None

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summaries(cls, value, info: ValidationInfo):
        if value is not None:
            raise _not_implemented(f"reasoning.{info.field_name} is not supported by this "
                                   "server yet: reasoning comes back whole, as reasoning text")
        return value


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true, as OpenAI
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's prefix-cache isolation
    session_id: str | None = Field(None, min_length=1)  # kvserve: keep its KV for next turn
    # vLLM's: arguments for the server's custom logits processors, as in chat
    vllm_xargs: dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None  # its effort; summaries are a 400
    # metadata and hints that change nothing here: accepted
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # not implemented: a 400 unless the value asks for nothing
    background: Any = None
    include: Any = None
    truncation: Any = None
    conversation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    context_management: Any = None
    prompt_cache_retention: Any = None

    _not_implemented = field_validator(*_NOT_IMPLEMENTED)(
        refuse_not_implemented(_NOT_IMPLEMENTED))

    @field_validator("input", mode="before")
    @classmethod
    def _supported_items(cls, value):
        return _typed_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value):
        for index, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise _not_implemented(f"tools[{index}]: tools of type {kind!r} are not "
                                       "supported by this server; only function tools")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_an_offered_tool(cls, choice, info: ValidationInfo):
        names = {tool.name for tool in info.data.get("tools") or []}
        if choice is not None and choice != "none" and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, ToolChoiceFunction) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return choice

    @property
    def stores(self) -> bool:
        return self.store is not False

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat-completions request that serves this one, given the conversation as chat
        messages (see `conversation.chat_messages`)."""
        if not messages:
            raise InvalidRequestError("input is empty and there are no instructions or "
                                      "previous_response_id to answer", param="input")
        choice = self.tool_choice
        fields = {
            "model": self.model, "messages": messages, "seed": self.seed,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "user": self.user, "cache_salt": self.cache_salt,
            "session_id": self.session_id, "prompt_cache_key": self.prompt_cache_key,
            "tools": [tool.as_chat_tool() for tool in self.tools] if self.tools else None,
            "tool_choice": ({"type": "function", "function": {"name": choice.name}}
                            if isinstance(choice, ToolChoiceFunction) else choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "vllm_xargs": self.vllm_xargs,
            "response_format": (self.text.format.response_format()
                                if self.text and self.text.format else None),
        }
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:  # the fields above were validated already
            raise InvalidRequestError(f"input: {exc.errors()[0].get('msg')}",
                                      param="input") from exc
