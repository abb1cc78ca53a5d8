"""OpenAI's Responses API (`POST /v1/responses`) on the wire: the request, the response object,
its output items and usage, as pydantic models.

Requests are validated as strictly as the chat request (`kvpool/openai/protocol.py`'s
`RequestModel`). `input` items and `tools` arrive as loose objects and are checked one by one
in `convert.py` against the models here, so that an error names the item (`input[2]`,
`tools[0].type`) rather than pydantic's union branches. Fields the request does not declare
are kept (`model_extra`), so that those kvpool refuses (`previous_response_id`, `background`,
...) get a 400 naming them, and the rest are ignored, as the chat routes ignore them.

The response models follow the openai client's types (`openai.types.responses`): every field
those mark as required is filled, so the client parses each object and event into its typed
classes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from kvpool.openai.protocol import Int32, RequestModel, StructuredOutputsRequest

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# ------------------------------------------------------------------ the request
class InputContentPart(RequestModel):
    """A message's content part; only text parts (`input_text`, `output_text`) are taken,
    which `convert.py` checks so that another type is refused by name."""

    type: str
    text: str | None = None


class InputMessage(RequestModel):
    """A message item, with or without `"type": "message"` (the easy form)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContentPart]


class InputFunctionCall(RequestModel):
    """A call the model made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON string


class InputFunctionCallOutput(RequestModel):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputContentPart]


class InputReasoning(RequestModel):
    """A reasoning item sent back with the rest of an earlier output; it is dropped, as chat
    templates drop earlier thinking."""

    type: Literal["reasoning"]


INPUT_ITEMS: dict[str, type[RequestModel]] = {
    "message": InputMessage,
    "function_call": InputFunctionCall,
    "function_call_output": InputFunctionCallOutput,
    "reasoning": InputReasoning,
}


class Tool(RequestModel):
    """A tool; only `function` tools are served (`convert.py` refuses the others by name)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class TextFormat(RequestModel):
    """`text.format`: `{"type": "text" | "json_object" | "json_schema", ...}`; `type` is a
    plain string so that another value gets a 400 naming `text.format.type`."""

    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None


MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(extra="allow")  # kept for the refused-field check

    model: str | None = None  # None: the served model
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None  # None: true
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    text: TextConfig | None = None
    stream: bool = False
    # vLLM's extensions, as on the chat routes
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None


# ------------------------------------------------------------------ the response
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)  # kvpool cites nothing


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The thinking, with `--reasoning-parser`: its text as `content`; kvpool writes no
    summary."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # a JSON string
    status: ItemStatus


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0  # kvpool does not count cache writes per request


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"]
    message: str


class EchoedTool(BaseModel):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseObject(BaseModel):
    """The response: the request's settings echoed, then what the generation made."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, str] = "auto"
    tools: list[EchoedTool] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    user: str | None = None
    previous_response_id: None = None  # stateless: never set
    background: Literal[False] = False
    store: Literal[False] = False  # nothing is stored
    truncation: Literal["disabled"] = "disabled"
