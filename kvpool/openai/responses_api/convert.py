"""A Responses request as the chat request kvpool already serves, and the chat pipeline's
output as a Responses object: the Responses API is a translation, not a second generation path.

    input (string)                  one user message
    input message items             chat messages (`developer`, `system`, `user`, `assistant`)
    function_call items             an assistant message's `tool_calls` (consecutive calls,
                                    and calls right after an assistant message, join it)
    function_call_output items      `tool` messages answering them by `call_id`
    reasoning items                 dropped, as chat templates drop earlier thinking
    instructions                    a system message before the input
    max_output_tokens               max_completion_tokens
    tools (function), tool_choice   tools, tool_choice (required / named: constrained)
    text.format                     response_format
    cache_salt, structured_outputs  the same (vLLM's extensions)

Back: the thinking (with `--reasoning-parser`) becomes a `reasoning` item, the content a
`message` item, each call a `function_call` item, in that order; a response that produced
none of them gets an empty message, so `output` is never empty. When `max_output_tokens` cut
the output, the last item is `incomplete`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import ValidationError

from kvpool.openai.errors import bad_request, validation_message
from kvpool.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    RequestModel,
    ResponseFormat,
    ToolCall,
    ToolDefinition,
    Usage,
)
from kvpool.openai.protocol import ToolChoice as ChatToolChoice
from kvpool.openai.responses_api.protocol import (
    INPUT_ITEMS,
    EchoedTool,
    FunctionCallItem,
    FunctionChoice,
    IncompleteDetails,
    InputContentPart,
    InputFunctionCall,
    InputFunctionCallOutput,
    InputMessage,
    InputTokensDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    Tool,
)
from kvpool.openai.tools.output import new_call_id
from kvpool.openai.tools.parser import ParsedOutput

TEXT_PARTS = ("input_text", "output_text")
TEXT_FORMATS = ("text", "json_object", "json_schema")
# Tools OpenAI runs itself; named in the refusal, any other type is refused without its name.
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter",
                  "computer_use_preview", "image_generation", "mcp", "local_shell", "shell",
                  "apply_patch", "custom")


# ------------------------------------------------------------------ request → chat
def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response (400s for what cannot be translated)."""
    messages = input_messages(request.input)
    if request.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=request.instructions))
    return ChatCompletionRequest(
        model=request.model, messages=messages, max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, user=request.user,
        parallel_tool_calls=request.parallel_tool_calls, tools=_chat_tools(request.tools),
        tool_choice=_chat_tool_choice(request.tool_choice),
        response_format=_response_format(request.text), stream=request.stream,
        cache_salt=request.cache_salt, structured_outputs=request.structured_outputs,
    )


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for index, raw in enumerate(items):
        item = _input_item(index, raw)
        if isinstance(item, InputMessage):
            content = _text_parts(item.content, f"input[{index}].content")
            messages.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, InputFunctionCall):
            _add_call(messages, item)
        elif isinstance(item, InputFunctionCallOutput):
            output = _text_parts(item.output, f"input[{index}].output")
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
    if not messages:
        raise bad_request("input must hold at least one message", "input")
    return messages


def _input_item(index: int, raw: dict[str, Any]) -> RequestModel:
    kind = raw.get("type", "message")
    model = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(f"input[{index}].type must be one of {', '.join(INPUT_ITEMS)}",
                          f"input[{index}].type")
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        message, _ = validation_message(error.errors())
        raise bad_request(f"input[{index}].{message}", f"input[{index}]") from error


def _text_parts(content: str | list[InputContentPart], param: str) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    parts = []
    for index, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise bad_request(f"{param}[{index}]: only text parts ({', '.join(TEXT_PARTS)}) "
                              "with their text are supported", f"{param}[{index}]")
        parts.append(ContentPart(type="text", text=part.text))
    return parts


def _add_call(messages: list[ChatMessage], item: InputFunctionCall) -> None:
    """The call joins the assistant message just before it, or starts one."""
    call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                           arguments=item.arguments))
    if messages and messages[-1].role == "assistant":
        last = messages[-1]
        messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
    else:
        messages.append(ChatMessage(role="assistant", tool_calls=[call]))


def _chat_tools(tools: list[Tool] | None) -> list[ToolDefinition] | None:
    if tools is None:
        return None
    return [_chat_tool(index, tool) for index, tool in enumerate(tools)]


def _chat_tool(index: int, tool: Tool) -> ToolDefinition:
    param = f"tools[{index}]"
    if tool.type != "function":
        what = f"the built-in tool {tool.type}" if tool.type in BUILT_IN_TOOLS else "this tool"
        raise bad_request(f"{what} is not supported: only function tools are",
                          f"{param}.type")
    if tool.name is None:
        raise bad_request("a function tool needs a name", f"{param}.name")
    return ToolDefinition(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters,
        strict=tool.strict))


def _chat_tool_choice(choice: str | FunctionChoice | None) -> ChatToolChoice | None:
    if isinstance(choice, FunctionChoice):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return choice  # type: ignore[return-value]


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    form = None if text is None else text.format
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return ResponseFormat(type="json_object")
    if form.type != "json_schema":
        raise bad_request(f"text.format.type must be one of {', '.join(TEXT_FORMATS)}",
                          "text.format.type")
    if form.name is None:
        raise bad_request("text.format.name is required with type json_schema",
                          "text.format.name")
    if form.schema_ is None:
        raise bad_request("text.format.schema is required with type json_schema",
                          "text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=form.name, description=form.description, schema=form.schema_, strict=form.strict))


# ------------------------------------------------------------------ output → response
def response_shell(request: ResponsesRequest, response_id: str, created_at: int,
                   model: str) -> ResponseObject:
    """The response before any output: the request's settings echoed, `in_progress`. Built
    after `chat_request`, which refused tools without a name. A 400 if an echoed string
    cannot be encoded (a lone surrogate), which would fail the reply."""
    tools = [EchoedTool(name=tool.name or "", description=tool.description,
                        parameters=tool.parameters, strict=tool.strict)
             for tool in request.tools or []]
    choice = request.tool_choice or "auto"
    shell = ResponseObject(
        id=response_id, created_at=created_at, status="in_progress", model=model,
        instructions=request.instructions, metadata=request.metadata or {},
        max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        temperature=request.temperature, top_p=request.top_p,
        tool_choice=choice if isinstance(choice, str) else choice.model_dump(), tools=tools,
        user=request.user,
    )
    if request.text is not None and request.text.format is not None:
        shell.text = {"format": request.text.format.model_dump(by_alias=True,
                                                               exclude_none=True)}
    try:
        json.dumps(shell.model_dump(), ensure_ascii=False).encode()
    except UnicodeEncodeError as error:
        raise bad_request("the request holds text that is not valid Unicode") from error
    return shell


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(identifier: str, text: str, status: ItemStatus) -> ReasoningItem:
    return ReasoningItem(id=identifier, content=[ReasoningText(text=text)], status=status)


def message_item(identifier: str, text: str, status: ItemStatus) -> OutputMessage:
    return OutputMessage(id=identifier, content=[OutputText(text=text)], status=status)


def call_item(identifier: str, call_id: str, name: str, arguments: str,
              status: ItemStatus) -> FunctionCallItem:
    return FunctionCallItem(id=identifier, call_id=call_id, name=name, arguments=arguments,
                            status=status)


def output_items(parsed: ParsedOutput, is_cut: bool) -> list[OutputItem]:
    """A whole output's items (module docstring), the last `incomplete` if it was cut."""
    items: list[OutputItem] = []
    if parsed.reasoning is not None:
        items.append(reasoning_item(item_id("rs"), parsed.reasoning, "completed"))
    if parsed.content is not None or not (items or parsed.calls):
        items.append(message_item(item_id("msg"), parsed.content or "", "completed"))
    items += [call_item(item_id("fc"), new_call_id(), call.name, call.arguments, "completed")
              for call in parsed.calls]
    if is_cut:
        items[-1] = items[-1].model_copy(update={"status": "incomplete"})
    return items


def finished_response(shell: ResponseObject, items: list[OutputItem], is_cut: bool,
                      usage: ResponseUsage) -> ResponseObject:
    """The shell with its output: `completed`, or `incomplete` when max_output_tokens (or the
    context) cut it."""
    details = IncompleteDetails(reason="max_output_tokens") if is_cut else None
    return shell.model_copy(update={
        "status": "incomplete" if is_cut else "completed", "output": items, "usage": usage,
        "incomplete_details": details,
    })


def responses_usage(usage: Usage, num_reasoning_tokens: int) -> ResponseUsage:
    """The chat usage (one owner of the counting) in the Responses shape."""
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=min(num_reasoning_tokens, usage.completion_tokens)),
        total_tokens=usage.total_tokens,
    )
