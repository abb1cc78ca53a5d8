"""The OpenAI wire format: request and response bodies as pydantic models.

Requests are validated strictly (a string where a number belongs is an error, not a
conversion) and reject NaN/Infinity; ranges of sampling values are checked later by
`SamplingParams`, so there is one source of truth for their messages. Integer fields carry
wide sanity bounds only, so an absurd number never reaches arithmetic or an error message.
Unknown fields are ignored, as vLLM does, so tools that send extra OpenAI options still work.

Extensions beyond OpenAI, named as in vLLM: `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `cache_salt`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
Int32 = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: Int32 = 1
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    min_tokens: Int32 = 0
    ignore_eos: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int32 | None = None  # None: 16, as OpenAI (less if the context is shorter)
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int32 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int32 | None = None  # None: whatever the context leaves
    logprobs: bool = False
    top_logprobs: Int32 | None = None


# ---------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A completion, or with `stream` one chunk of it (same shape, as in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


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
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvpool"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
