"""Request bodies of POST /v1/messages and /v1/messages/count_tokens. Whatever the server
would not honour is refused by name before anything runs (a 400): unknown fields, content
blocks other than text / tool_use / tool_result / thinking, server tools. `thinking` is
`thinking.ThinkingConfig`; an earlier answer's thinking blocks are accepted back.
Prompt-caching hints (`cache_control`) pass anywhere, since the prefix cache here is automatic.

The chat-completions request that serves one (`chat_request`) is built here and nowhere
else: rendering, tool grammars and sampling are then the chat route's own."""

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

from kvserve.entrypoints.openai.anthropic.conversation import chat_messages
from kvserve.entrypoints.openai.anthropic.thinking import ThinkingConfig, check_budget
from kvserve.entrypoints.openai.protocol import (
    FUNCTION_NAME_PATTERN,
    ChatCompletionRequest,
    RequestBody,
    refuse_not_implemented,
)
from kvserve.errors import InvalidRequestError

# the content blocks each place takes; any other type is refused by name
MESSAGE_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
RESULT_BLOCK_TYPES = ("text",)
# Anthropic fields the server does not implement -> the values that ask for nothing
_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "container": (),
    "mcp_servers": ([],),
    "context_management": (),
    "diagnostics": (),
}
# Anthropic's tool_choice types -> chat's
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _not_implemented(message: str) -> PydanticCustomError:
    return PydanticCustomError("not_implemented", message)


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_control: Any = None  # a prompt-caching breakpoint: the prefix cache is automatic


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: Any = None  # an earlier answer's citations sent back: not read


# fields of blocks sent back as the client received them -> the values that ask for nothing
# (toolsets and calls made by code execution are not implemented)
_BLOCK_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {"caller": ({"type": "direct"},),
                                                      "toolset_name": ()}


class ToolUseBlock(_Block):
    """An earlier answer's tool call sent back."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    caller: Any = None
    toolset_name: Any = None

    _not_implemented = field_validator(*_BLOCK_NOT_IMPLEMENTED)(
        refuse_not_implemented(_BLOCK_NOT_IMPLEMENTED))


class ThinkingBlock(_Block):
    """An earlier answer's thinking sent back (clients must, in a tool-use loop): the template
    renders it where it keeps thinking (Qwen3's: the turns after the last user query, as
    Anthropic keeps only the current tool loop's), and drops it elsewhere."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # this server signs nothing: any value is accepted back


class RedactedThinkingBlock(_Block):
    """Another server's encrypted thinking: unreadable here, so dropped from the prompt."""

    type: Literal["redacted_thinking"]
    data: str


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] = []
    is_error: bool = False
    toolset_name: Any = None

    _not_implemented = field_validator("toolset_name")(
        refuse_not_implemented(_BLOCK_NOT_IMPLEMENTED))

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        return _checked_blocks(value, RESULT_BLOCK_TYPES)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                  | RedactedThinkingBlock, Field(discriminator="type")]


def _checked_blocks(blocks: Any, allowed: tuple[str, ...]) -> Any:
    """`blocks` as a list (a string is shorthand for one text block), once every block's type
    is one of `allowed`; another type (image, document, server tool results) is
    refused by name and place."""
    if isinstance(blocks, str):
        return [{"type": "text", "text": blocks}]
    for number, block in enumerate(blocks if isinstance(blocks, list) else []):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise _not_implemented(f"content blocks of type {kind!r} are not supported by this "
                                   f"server (block {number}); send {', '.join(allowed)} blocks")
    return blocks


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _supported_blocks(cls, value):
        return _checked_blocks(value, MESSAGE_BLOCK_TYPES)


class Tool(BaseModel):
    """A custom (client) tool: the model calls it with `input` following `input_schema`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Any = None
    strict: bool | None = None  # calls follow the schema either way
    eager_input_streaming: bool | None = None  # a call's input streams as written either way

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, schema):
        if schema.get("type") != "object":
            raise ValueError('input_schema must be a JSON schema of "type": "object"')
        return schema

    def as_chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice.name is needed with type "tool", and only with it')
        return self

    def as_chat_choice(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return _TOOL_CHOICES[self.type]


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """output_config: structured output (a JSON schema the text follows, chat's
    response_format) and the reasoning effort (chat's reasoning_effort, which templates such
    as gpt-oss's read)."""

    model_config = ConfigDict(extra="forbid")
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high"] | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None


class _Conversation(RequestBody):
    """What both routes render: the conversation, its tools and output format."""

    model: str
    messages: list[Message] = Field(..., min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    cache_control: Any = None  # top-level caching hint: the prefix cache is automatic
    # not implemented: a 400 unless the value asks for nothing
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    diagnostics: Any = None

    _not_implemented = field_validator(*_NOT_IMPLEMENTED)(
        refuse_not_implemented(_NOT_IMPLEMENTED))

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value):
        return _checked_blocks(value, RESULT_BLOCK_TYPES)

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools_only(cls, value):
        for number, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise _not_implemented(f"tools.{number}: tools of type {kind!r} (server "
                                       "tools) are not supported by this server; only custom "
                                       "tools (name, description, input_schema)")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_an_offered_tool(cls, choice, info: ValidationInfo):
        names = {tool.name for tool in info.data.get("tools") or []}
        if choice is not None and choice.type != "none" and not names:
            raise ValueError("tool_choice needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return choice

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields for the conversation, tools and output format."""
        choice = self.tool_choice
        output = self.output_config
        return {
            "model": self.model, "messages": chat_messages(self.system, self.messages),
            "tools": [tool.as_chat_tool() for tool in self.tools] if self.tools else None,
            "tool_choice": choice.as_chat_choice() if choice else None,
            "parallel_tool_calls": (False if choice and choice.disable_parallel_tool_use
                                    else None),
            "response_format": ({"type": "json_schema", "json_schema": {
                "name": "output", "schema": output.format.schema_}}
                if output and output.format else None),
            "reasoning_effort": output.effort if output else None,
            **(self.thinking.chat_fields() if self.thinking else {}),
        }

    def chat_request(self) -> ChatCompletionRequest:
        """The chat-completions request that serves this one."""
        fields = self.chat_fields()
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:  # the fields above were validated already
            raise InvalidRequestError(f"messages: {exc.errors()[0].get('msg')}",
                                      param="messages") from exc


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the prompt /v1/messages would render, counted."""


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    # hints and attribution that change nothing here: accepted
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # vLLM's: arguments for the server's custom logits processors (--logits-processors)
    vllm_xargs: dict[str, Any] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _room_after_thinking(cls, max_tokens, info: ValidationInfo):
        check_budget(info.data.get("thinking"), max_tokens)
        return max_tokens

    def chat_fields(self) -> dict[str, Any]:
        return {**super().chat_fields(), "max_tokens": self.max_tokens,
                "stop": self.stop_sequences or None, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k,
                "user": self.metadata.user_id if self.metadata else None,
                "vllm_xargs": self.vllm_xargs}
