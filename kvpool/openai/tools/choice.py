"""What a chat request's `tools` and `tool_choice` ask of the generation: `ToolPlan`.

    tool_choice   prompt lists the tools   decoding                      output read as
    none          no                       free                          content
    auto          yes                      free                          content + parsed calls
    required      yes                      JSON array of calls (below)   calls
    {"function"}  yes                      JSON of that function's args  one call

`tool_choice` defaults to `auto` when tools are given, else `none` (OpenAI). With `required`
or a named function the output is constrained as vLLM constrains it, so the arguments always
validate against the function's `parameters`: a named function's output is its arguments
object; `required`'s is `[{"name": <one of the names>, "parameters": {...}}, ...]` with at
least one item (at most one with `parallel_tool_calls: false`), each item's parameters tied to
its name by `anyOf`. `$defs` inside the tools' parameters move to the root, where their `$ref`s
resolve. A parameters schema the grammar compiler refuses is a 400 naming
`tools[i].function.parameters`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from kvpool.openai.errors import OpenAIError, bad_request
from kvpool.openai.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from kvpool.openai.structured import Constraint, compile_constraint, make_constraint

ToolMode = Literal["none", "auto", "required", "named"]
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: ToolMode
    tools: list[ToolDefinition]  # those the prompt lists (none for mode "none")
    function_name: str | None = None  # the named function
    is_parallel: bool = True  # several calls allowed
    constraint: Constraint | None = None  # required / named

    @property
    def is_active(self) -> bool:
        return self.mode != "none"


def plan_tools(request: ChatCompletionRequest) -> ToolPlan:
    """The request's plan; 400 for tools or a tool_choice that do not fit together."""
    tools = request.tools
    if tools is not None and not tools:
        raise bad_request("tools must not be empty (leave it out instead)", "tools")
    tools = tools or []
    _check_names(tools)
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    is_parallel = request.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", [])
    if choice == "auto":
        return ToolPlan("auto", tools, is_parallel=is_parallel)
    if choice == "required":
        schema = _calls_schema(tools, is_parallel)
        return ToolPlan("required", tools, None, is_parallel,
                        make_constraint("tools", json=schema))
    assert isinstance(choice, NamedToolChoice)
    index = _tool_index(tools, choice.function.name)
    return ToolPlan("named", tools, choice.function.name, False,
                    make_constraint(_parameters_param(index), json=_parameters(tools[index])))


def compile_tool_constraint(compiler: Any, plan: ToolPlan) -> None:
    """Compile the plan's constraint; if the grammar compiler refuses the combined schema of
    `required`, find the tool whose parameters it refuses, to name it."""
    if plan.constraint is None:
        return
    try:
        compile_constraint(compiler, plan.constraint)
    except OpenAIError:
        if plan.mode != "required":
            raise
        for index, tool in enumerate(plan.tools):
            compile_constraint(compiler, make_constraint(_parameters_param(index),
                                                       json=_parameters(tool)))
        raise


def _check_names(tools: list[ToolDefinition]) -> None:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not name:
            raise bad_request("a function name must not be empty", f"tools[{index}].function.name")
        if name in seen:
            raise bad_request("function names must be unique", f"tools[{index}].function.name")
        seen.add(name)


def _tool_index(tools: list[ToolDefinition], name: str) -> int:
    for index, tool in enumerate(tools):
        if tool.function.name == name:
            return index
    raise bad_request("tool_choice names a function that is not in tools",
                      "tool_choice.function.name")


def _parameters_param(index: int) -> str:
    return f"tools[{index}].function.parameters"


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    """The function's parameters schema (a copy); no parameters: an empty object."""
    return copy.deepcopy(tool.function.parameters) if tool.function.parameters else dict(
        _NO_ARGUMENTS)


def _calls_schema(tools: list[ToolDefinition], is_parallel: bool) -> dict[str, Any]:
    """`required`'s schema: an array of {"name", "parameters"} items, one variant per tool."""
    variants = []
    defs: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        parameters = _parameters(tool)
        tool_defs = parameters.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise bad_request("$defs must be an object", _parameters_param(index))
        for name, schema in tool_defs.items():
            if defs.setdefault(name, schema) != schema:
                raise bad_request("tools define the same $defs name differently",
                                  _parameters_param(index))
        variants.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if not is_parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
