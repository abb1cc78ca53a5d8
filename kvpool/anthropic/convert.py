"""Between Anthropic's Messages API and the chat completions path that does the work.

In: a `MessagesRequest` becomes the `ChatCompletionRequest` that asks for the same generation,
so the prompt, the tool plan, the constraints and the sampling are the chat path's own:

    system (text or text blocks)    a first "system" message
    user text blocks                a "user" message (consecutive blocks together)
    user tool_result blocks         a "tool" message each, in place (tool_call_id = tool_use_id)
    assistant text / tool_use       one "assistant" message: its text and tool_calls
    assistant thinking              dropped, as chat templates drop earlier thinking
    a last assistant turn           continued (continue_final_message), as Anthropic's prefill
    tools (input_schema)            functions (parameters)
    tool_choice auto/any/tool/none  "auto" / "required" / the named function / "none";
                                    disable_parallel_tool_use: parallel_tool_calls false
    thinking enabled / disabled     chat_template_kwargs enable_thinking true / false
    max_tokens, temperature, top_p, top_k, stop_sequences, stream: as they are (stop)

Out: the output, read by the request's own reader (thinking, text, tool calls: `ParsedOutput`)
becomes a `Message`: a thinking block, a text block, a tool_use block per call, in that order.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from itertools import groupby
from typing import Any

from kvpool.anthropic.protocol import (
    ContentBlock,
    ContentBlockParam,
    CountTokensRequest,
    Message,
    MessageParam,
    MessagesRequest,
    StopReason,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ToolChoice,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
    Usage,
)
from kvpool.engine.requests.outputs import CompletionOutput, RequestOutput
from kvpool.openai.errors import bad_request
from kvpool.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)
from kvpool.openai.tools.parser import ParsedOutput, ToolParser

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool": a named function


# ------------------------------------------------------------------ request
def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks for what `body` asks for."""
    return ChatCompletionRequest(
        **conversation(body), model=body.model, max_tokens=body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        stop=body.stop_sequences, stream=body.stream,
    )


def counting_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """A chat request with `body`'s prompt (what count_tokens renders)."""
    return ChatCompletionRequest(**conversation(body), model=body.model)


def conversation(body: CountTokensRequest) -> dict[str, Any]:
    """The chat request's fields that make its prompt: messages, tools, template options."""
    messages = [ChatMessage(role="system", content=_parts(body.system))] if body.system else []
    for index, message in enumerate(body.messages):
        messages += _chat_messages(message, f"messages.{index}.content")
    fields: dict[str, Any] = {"messages": messages, **_tool_fields(body)}
    if body.messages and body.messages[-1].role == "assistant":
        fields |= {"add_generation_prompt": False, "continue_final_message": True}
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    return fields


def _parts(blocks: Iterable[TextBlockParam]) -> list[ContentPart]:
    return [ContentPart(type="text", text=block.text) for block in blocks]


def _chat_messages(message: MessageParam, param: str) -> list[ChatMessage]:
    if message.role == "assistant":
        return [_assistant_message(message.content, param)]
    return _user_messages(message.content, param)


def _assistant_message(blocks: list[ContentBlockParam], param: str) -> ChatMessage:
    """Its text and its calls; earlier thinking is left out."""
    if any(isinstance(block, ToolResultBlockParam) for block in blocks):
        raise bad_request("tool_result blocks belong in user turns", param)
    texts = _parts(block for block in blocks if isinstance(block, TextBlockParam))
    calls = [_tool_call(block) for block in blocks if isinstance(block, ToolUseBlockParam)]
    return ChatMessage(role="assistant", content=texts or None, tool_calls=calls or None)


def _tool_call(block: ToolUseBlockParam) -> ToolCall:
    arguments = json.dumps(block.input, ensure_ascii=False)
    return ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=arguments))


def _user_messages(blocks: list[ContentBlockParam], param: str) -> list[ChatMessage]:
    """Consecutive text blocks as one user message, each tool result as a tool message, in
    their order."""
    for block in blocks:
        if not isinstance(block, TextBlockParam | ToolResultBlockParam):
            raise bad_request(f"{block.type} blocks belong in assistant turns", param)
    messages: list[ChatMessage] = []
    for is_result, group in groupby(blocks, key=lambda block: block.type == "tool_result"):
        if is_result:
            messages += [ChatMessage(role="tool", tool_call_id=result.tool_use_id,
                                     content=_parts(result.content)) for result in group]
        else:
            messages.append(ChatMessage(role="user", content=_parts(list(group))))
    return messages


def _tool_fields(body: CountTokensRequest) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls. Without tools, a tool_choice that asks for
    no call ("auto", "none") asks for nothing; any other is refused by the chat path."""
    tools = None if body.tools is None else [_function(tool) for tool in body.tools]
    choice = body.tool_choice
    if choice is None or (not tools and choice.type in ("auto", "none")):
        return {"tools": tools}
    is_single = not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use
    return {"tools": tools, "tool_choice": _openai_choice(choice),
            "parallel_tool_calls": False if is_single else None}


def _openai_choice(choice: ToolChoice) -> str | NamedToolChoice:
    if isinstance(choice, ToolChoiceTool):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return _CHOICES[choice.type]


def _function(tool: ToolParam) -> ToolDefinition:
    return ToolDefinition(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.input_schema))


# ------------------------------------------------------------------ response
def message_response(response_id: str, model: str, output: RequestOutput, reader: ToolParser,
                     stop_sequences: list[str] | None) -> Message:
    """The `Message` of a finished output; `reader` is the chat path's (`inputs.output_parser`)."""
    completion = output.outputs[0]
    content = content_blocks(reader.read(completion.text))
    num_calls = sum(isinstance(block, ToolUseBlock) for block in content)
    reason, sequence = stop_reason(completion, num_calls, stop_sequences)
    return Message(id=response_id, model=model, content=content, stop_reason=reason,
                   stop_sequence=sequence,
                   usage=usage(output, len(completion.token_ids)))


def content_blocks(parsed: ParsedOutput) -> list[ContentBlock]:
    """Thinking, then text, then one tool_use block per call. A call whose arguments are not a
    JSON object (one cut off by max_tokens) cannot be a tool_use block: it stays text."""
    blocks: list[ContentBlock] = []
    if parsed.reasoning:
        blocks.append(ThinkingBlock(thinking=parsed.reasoning))
    if parsed.content:
        blocks.append(TextBlock(text=parsed.content))
    for call in parsed.calls:
        arguments = _object(call.arguments)
        blocks.append(TextBlock(text=call.arguments) if arguments is None else
                      ToolUseBlock(id=new_tool_use_id(), name=call.name, input=arguments))
    return blocks


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def stop_reason(completion: CompletionOutput, num_calls: int,
                stop_sequences: list[str] | None) -> tuple[StopReason, str | None]:
    """Why the output ended, and the stop sequence that ended it: `max_tokens` for a cut, else
    `tool_use` if it called, `stop_sequence` for one of the request's, else `end_turn`."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    sequence = completion.stop_reason
    if isinstance(sequence, str) and sequence in (stop_sequences or ()):
        return "stop_sequence", sequence
    return "end_turn", None


def usage(output: RequestOutput, num_output_tokens: int) -> Usage:
    num_cached = output.num_cached_tokens
    return Usage(input_tokens=len(output.prompt_token_ids) - num_cached,
                 output_tokens=num_output_tokens, cache_read_input_tokens=num_cached)


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"
