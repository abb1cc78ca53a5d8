"""What a chat request's `tools` and `tool_choice` ask of the generation: `ToolPlan`.

    tool_choice   prompt lists the tools   decoding                      output read as
    none          no                       free                          content
    auto          yes                      free                          content + parsed calls
    required      yes                      JSON array of calls (below)   calls
    {"function"}  yes                      JSON of that function's args  one call

`tool_choice` defaults to `auto` when tools are given, else `none` (OpenAI). With `required`
or a named function the output is constrained as vLLM constrains it, so the arguments always
validate against the function's `parameters`: a named function's output is its arguments
object; `required`'s is a JSON array of 1 to 8 calls (exactly 1 with `parallel_tool_calls:
false`) in a grammar that always ends (`required_calls`). `tool_choice: "any"` (LangChain's
name) means `required`. A parameters schema the grammar compiler refuses is a 400 naming
`tools[i].function.parameters`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvpool.openai.errors import OpenAIError, bad_request
from kvpool.openai.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from kvpool.openai.structured import Constraint, compile_constraint, make_constraint
from kvpool.openai.tools.required_calls import (
    parameters_param,
    required_calls_grammar,
    tool_parameters,
)

ToolMode = Literal["none", "auto", "required", "named"]


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
    if choice in ("required", "any"):
        grammar = required_calls_grammar(tools, is_parallel)
        return ToolPlan("required", tools, None, is_parallel,
                        make_constraint("tools", grammar=grammar))
    assert isinstance(choice, NamedToolChoice)
    index = _tool_index(tools, choice.function.name)
    return ToolPlan("named", tools, choice.function.name, False,
                    make_constraint(parameters_param(index), json=tool_parameters(tools[index])))


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
            compile_constraint(compiler, make_constraint(parameters_param(index),
                                                         json=tool_parameters(tool)))
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

