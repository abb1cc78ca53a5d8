"""Anthropic's Messages API wire format: the request bodies of `POST /v1/messages` and
`/v1/messages/count_tokens`, the `Message` a request gets back, the events of its stream and
the error body.

Requests are validated as strictly as the OpenAI bodies (`RequestModel`: no string where a
number belongs, no NaN). Unknown fields are ignored, as the OpenAI routes ignore them, so a
client that sends options newer than this server still works. A string where Anthropic also
takes a list of text blocks (a message's content, `system`, a tool result's content) is read
as one text block, so everything past validation sees lists only. Content blocks are told
apart by `type`; a type not declared here (image, document, a server tool's blocks) is a 400
naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from kvpool.openai.protocol import INT32_MAX, Int32, RequestModel


def _as_blocks(value: Any) -> Any:
    """A bare string as the one text block it stands for."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


# ------------------------------------------------------------------ request
class TextBlockParam(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: prefix caching is automatic


TextBlocks = Annotated[list[TextBlockParam], BeforeValidator(
    _as_blocks, json_schema_input_type=str | list[TextBlockParam])]


class ToolUseBlockParam(RequestModel):
    """A call the assistant made (in an assistant turn)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlockParam(RequestModel):
    """A call's result (in a user turn), answering the `tool_use` block of `tool_use_id`."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: TextBlocks = Field(default_factory=list)
    is_error: bool | None = None  # accepted; the result's text is what the model reads
    cache_control: dict[str, Any] | None = None


class ThinkingBlockParam(RequestModel):
    """Earlier thinking sent back in an assistant turn; chat templates drop it."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(RequestModel):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlockParam], BeforeValidator(
        _as_blocks, json_schema_input_type=str | list[ContentBlockParam])]


class ToolParam(RequestModel):
    """A client tool: a function with a JSON-schema `input_schema`."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class ThinkingConfig(RequestModel):
    """Whether the model may think; `budget_tokens` is accepted and not enforced."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int32 | None = None


class CountTokensRequest(RequestModel):
    """What `/v1/messages/count_tokens` reads: the conversation, without sampling."""

    model: str
    messages: list[MessageParam]
    system: TextBlocks | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)]
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted and ignored


# ------------------------------------------------------------------ response
class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's encrypted proof; this server signs nothing


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str  # "toolu_…"
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    """As Anthropic counts: `input_tokens` are the prompt tokens not read from the cache, so
    the prompt is `input_tokens + cache_read_input_tokens` (nothing counts as written)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(BaseModel):
    id: str  # "msg_…"
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int


# ------------------------------------------------------------------ stream events
class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


# ------------------------------------------------------------------ errors
class ErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str


class ErrorResponse(BaseModel):
    """Every error on /v1/messages; also the `error` event that ends a failed stream."""

    type: Literal["error"] = "error"
    error: ErrorDetail
