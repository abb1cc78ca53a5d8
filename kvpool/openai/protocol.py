"""The OpenAI wire format: request and response bodies as pydantic models.

Requests are validated strictly (a string where a number belongs is an error, not a
conversion) and reject NaN/Infinity; ranges of sampling values are checked later by
`SamplingParams`, so there is one source of truth for their messages. Integer fields carry
wide sanity bounds only, so an absurd number never reaches arithmetic or an error message.

Unknown fields are ignored, as vLLM does, so tools that send extra OpenAI options still work;
the two request bodies keep them (`model_extra`), so that fields OpenAI or vLLM define but
kvpool does not honour get a 400 naming them instead of silence (`unsupported.py`).

Extensions beyond OpenAI, named as in vLLM: `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `cache_salt`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, `prompt_logprobs`, `allowed_token_ids`, `bad_words`,
`priority`, `structured_outputs`, and chat's `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `documents`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
Int32 = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False


# ------------------------------------------------------------ structured outputs
class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema`; the schema travels as `schema`."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": ...}`. `type` is a
    plain string here so that another value gets a 400 naming `response_format.type`."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs`: exactly one of the constraints (`json` is a schema)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options beyond the constraint itself; kvpool honours only their defaults.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")  # kept for the unsupported-field check

    model: str | None = None  # None: the served model
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: Int32 | None = 1  # None: 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None  # -1: none, as in vLLM
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    min_tokens: Int32 = 0
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Int32 | None = None
    priority: Int64 = 0  # lower runs earlier
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # Disaggregated serving, as vLLM's proxy sends it (`kvpool.engine.kv_connector.params`).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int32 | None = None  # None: 16, as OpenAI (less if the context is shorter)
    logprobs: Int32 | None = None
    echo: bool | None = False
    add_special_tokens: bool = True
    # Beam search (vLLM's fields): best_of beams (default n), the n best returned.
    use_beam_search: bool = False
    best_of: Int32 | None = None
    length_penalty: float = 1.0


class ContentPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """A call's function: its name and its arguments as a JSON string (request or response)."""

    model_config = ConfigDict(strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call, in an assistant message the client sends back or in a response."""

    model_config = ConfigDict(strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required", "any"] | NamedToolChoice  # any: required


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int32 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int32 | None = None  # None: whatever the context leaves
    logprobs: bool | None = False
    top_logprobs: Int32 | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # None: true
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None


# ---------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PromptLogprob(BaseModel):
    """One alternative at a prompt position (vLLM's `Logprob`, as its responses carry it)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per prompt token: None for the first (nothing precedes it), else token id -> its logprob.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    """Per token; with `echo`, the prompt's tokens come first, the very first with null
    `token_logprobs` and `top_logprobs` (nothing precedes it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM)
    prompt_logprobs: PromptLogprobs | None = None


class Completion(BaseModel):
    """A completion, or with `stream` one chunk of it (same shape, as in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill worker's handover (vLLM's)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # the thinking, with --reasoning-parser (vLLM's)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM puts them on the response
    kv_transfer_params: dict[str, Any] | None = None  # a prefill worker's handover (vLLM's)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first carries id, type and name, later ones
    arguments; pieces with the same `index` concatenate to one call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    """OpenAI's error fields as vLLM's `ErrorInfo` fills them: `code` is the HTTP status."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail
