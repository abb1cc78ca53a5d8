"""A chat request as the prompt text the model reads: its messages, tools and past tool calls.

A chat template that takes `tools` (one whose Jinja refers to a `tools` variable) gets them
as it expects: the tool definitions as `tools=`, assistant `tool_calls` with their arguments
parsed into objects (what Hugging Face templates read), `tool` messages with their
`tool_call_id`. Other templates (the bundled SmolLM2's) see only roles and text, so kvpool
writes the tools into the conversation itself, in the Hermes style its default parser reads:

- the system prompt gains a "# Tools" section: each function's JSON definition inside
  `<tools></tools>`, and how to call one: `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`; with `required` or a named function (whose output is constrained to plain
  JSON) it asks for that JSON instead;
- an assistant message's past calls follow its text as `<tool_call>` blocks;
- tool results become a user message of `<tool_response>` blocks (consecutive results
  merged), since such templates may know no `tool` role.

With `tool_choice: "none"` the tools are left out of the prompt (the model is not to call
them), as vLLM's `--exclude-tools-when-tool-choice-none` does; past calls are still shown.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from kvpool.openai.protocol import ChatMessage, ToolCall, ToolDefinition
from kvpool.openai.tools.choice import ToolPlan


def conversation(messages: list[ChatMessage], plan: ToolPlan, template: str | None
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages for the template, extra template arguments such as `tools`)."""
    if template_takes_tools(template or ""):
        extra = {"tools": [tool_json(tool) for tool in plan.tools]} if plan.tools else {}
        return [_native_message(message) for message in messages], extra
    rendered = _text_messages(messages)
    if plan.tools:
        rendered = _with_tool_section(rendered, tool_section(plan))
    return rendered, {}


@functools.lru_cache(maxsize=16)
def template_takes_tools(template: str) -> bool:
    """Whether the Jinja template reads a `tools` variable."""
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def tool_json(tool: ToolDefinition) -> dict[str, Any]:
    return tool.model_dump(exclude_none=True)


def tool_section(plan: ToolPlan) -> str:
    """The system-prompt section that lists the tools and says how to call them."""
    lines = [
        "# Tools",
        "",
        "You can call functions to help with the user's request. Each function is described "
        "by a JSON object inside <tools></tools>:",
        "<tools>",
        *(json.dumps(tool_json(tool), ensure_ascii=False) for tool in plan.tools),
        "</tools>",
        "",
    ]
    if plan.mode == "named":
        lines.append(f"Call the function {plan.function_name}: reply with only the JSON "
                     "object of its arguments.")
    elif plan.mode == "required":
        lines.append('Call one or more functions: reply with only a JSON array of calls, '
                     'each {"name": <function name>, "parameters": <arguments object>}.')
    else:
        lines += [
            "To call a function, reply with one <tool_call></tool_call> block per call, "
            "each holding a JSON object with the function's name and its arguments:",
            "<tool_call>",
            '{"name": <function name>, "arguments": <arguments object>}',
            "</tool_call>",
        ]
    return "\n".join(lines)


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def content_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def _native_message(message: ChatMessage) -> dict[str, Any]:
    result: dict[str, Any] = {"role": _role(message), "content": content_text(message)}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls:
        result["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name,
                          "arguments": _arguments_object(call.function.arguments)}}
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


def _text_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Roles and text only: past calls as `<tool_call>` text, results as user messages."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        text = content_text(message)
        if message.role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if rendered and rendered[-1].get("is_tool_response"):
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "is_tool_response": True})
            continue
        if message.tool_calls:
            blocks = [_call_text(call) for call in message.tool_calls]
            text = "\n".join([text, *blocks] if text else blocks)
        rendered.append({"role": _role(message), "content": text})
    return [{"role": m["role"], "content": m["content"]} for m in rendered]


def _call_text(call: ToolCall) -> str:
    body = {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _arguments_object(arguments: str) -> Any:
    """A past call's arguments as an object (templates expect one); kept as the string if it
    is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _with_tool_section(messages: list[dict[str, Any]], section: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{"role": "system", "content": f"{first}\n\n{section}" if first else section},
                *messages[1:]]
    return [{"role": "system", "content": section}, *messages]
