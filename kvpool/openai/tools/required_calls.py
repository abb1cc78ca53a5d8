"""`tool_choice: "required"`'s output format, and the grammar that makes every reply end.

The reply is a JSON array of calls, each `{"name": <one of the names>, "parameters": {...}}`
with its parameters tied to its name by `anyOf`:

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", ...}]

Invariant: the format is finite but for what the tools' own schemas leave open (an unbounded
string). It holds 1 to `MAX_REQUIRED_CALLS` calls (exactly 1 with `parallel_tool_calls:
false`), separators are fixed (`", "` and `": "`, no other whitespace between tokens), and the
array's closing `]` allows only the stop token. With JSON's free whitespace and no bound on the
array, a small model under greedy decoding wrote newlines, or one more parameterless call,
until `max_tokens` and the reply came back unparsed.

The schema is therefore turned into EBNF here (xgrammar's own JSON-schema conversion, without
free whitespace) and handed to the engine as a `grammar` constraint. `$defs` inside the tools'
parameters move to the root, where their `$ref`s resolve. A schema the conversion refuses is a
400 naming the first tool whose parameters it refuses on their own (`tools` if none does).
"""

from __future__ import annotations

import copy
from typing import Any

import xgrammar

from kvpool.openai.errors import bad_request
from kvpool.openai.protocol import ToolDefinition

MAX_REQUIRED_CALLS = 8  # calls in one `required` reply (parallel_tool_calls true)
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
_REFUSED = "the JSON schema is invalid or uses features that are not supported"


def required_calls_grammar(tools: list[ToolDefinition], is_parallel: bool) -> str:
    """The EBNF grammar of `required`'s reply for these tools."""
    schema = required_calls_schema(tools, is_parallel)
    try:
        return _to_ebnf(schema)
    except (RuntimeError, ValueError, TypeError):
        for index, tool in enumerate(tools):
            try:
                _to_ebnf(tool_parameters(tool))
            except (RuntimeError, ValueError, TypeError):
                raise bad_request(_REFUSED, parameters_param(index)) from None
        raise bad_request(_REFUSED, "tools") from None


def required_calls_schema(tools: list[ToolDefinition], is_parallel: bool) -> dict[str, Any]:
    """The JSON schema of `required`'s reply: a bounded array, one `anyOf` variant per tool."""
    variants = []
    defs: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        parameters = tool_parameters(tool)
        tool_defs = parameters.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise bad_request("$defs must be an object", parameters_param(index))
        for name, schema in tool_defs.items():
            if defs.setdefault(name, schema) != schema:
                raise bad_request("tools define the same $defs name differently",
                                  parameters_param(index))
        variants.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "maxItems": MAX_REQUIRED_CALLS if is_parallel else 1,
                              "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


def tool_parameters(tool: ToolDefinition) -> dict[str, Any]:
    """The function's parameters schema (a copy); no parameters: an empty object."""
    return copy.deepcopy(tool.function.parameters) if tool.function.parameters else dict(
        _NO_ARGUMENTS)


def parameters_param(index: int) -> str:
    return f"tools[{index}].function.parameters"


def _to_ebnf(schema: dict[str, Any]) -> str:
    # any_whitespace off: the separators are ", " and ": ", the form the tool prompt shows.
    return str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
