"""From a request's `response_format` or `structured_outputs` to the one constraint the engine
gets (`StructuredOutputsParams`), checked by compiling it before anything is queued.

OpenAI's `response_format` maps onto vLLM's `structured_outputs` as vLLM maps it:
`json_object` is any JSON object, `json_schema` its `schema`, `text` nothing. A request may
constrain its output one way only. Each `Constraint` remembers the field the client wrote it
in, so a schema or regex the grammar compiler refuses is a 400 whose `param` is that field
(`response_format.json_schema.schema`, `structured_outputs.regex`, `tools[0].function.
parameters`), never an engine error. Compiling here, in the input-building worker thread,
also fills the compiler's cache, so the engine thread only looks the grammar up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.structured_outputs import StructuredOutputsParams
from kvpool.openai.errors import bad_request
from kvpool.openai.protocol import ResponseFormat, SamplingFields, StructuredOutputsRequest

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")

# vLLM's structured_outputs options beyond the constraint, and the value kvpool honours.
_OPTION_DEFAULTS = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """A constraint on the output and the request field it came from."""

    spec: StructuredOutputsParams
    param: str


def request_constraint(request: SamplingFields) -> Constraint | None:
    """The constraint `response_format` or `structured_outputs` asks for (None: none); a 400
    for a malformed one or for both at once."""
    from_format = _from_response_format(request.response_format)
    from_fields = _from_structured_outputs(request.structured_outputs)
    if from_format is not None and from_fields is not None:
        raise bad_request("give response_format or structured_outputs, not both",
                          "response_format")
    return from_format or from_fields


def make_constraint(param: str, **spec: Any) -> Constraint:
    """A `Constraint` from `StructuredOutputsParams` fields; its own refusal (not exactly one
    kind, a schema that is not an object) is a 400 naming `param`."""
    try:
        return Constraint(StructuredOutputsParams(**spec), param)
    except InvalidRequestError as error:
        raise bad_request(str(error), param) from error


def compile_constraint(compiler: Any, constraint: Constraint) -> None:
    """Compile the constraint with `compiler` (anything with `compile(spec)`: the server's
    bounded compiler for this request's tenant, `kvpool.server.grammar_bounds`): a 400
    naming the client's field if it refuses."""
    try:
        compiler.compile(constraint.spec)
    except InvalidRequestError as error:
        raise bad_request(str(error), constraint.param) from error


def _from_response_format(response_format: ResponseFormat | None) -> Constraint | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return make_constraint("response_format", json_object=True)
    if response_format.type != "json_schema":
        raise bad_request("response_format.type must be one of " + ", ".join(
            RESPONSE_FORMAT_TYPES), "response_format.type")
    if response_format.json_schema is None:
        raise bad_request("response_format.json_schema is required with type json_schema",
                          "response_format.json_schema")
    schema = response_format.json_schema.schema_
    param = "response_format.json_schema.schema"
    if schema is None:
        raise bad_request("response_format.json_schema.schema is required", param)
    return make_constraint(param, json=schema)


def _from_structured_outputs(fields: StructuredOutputsRequest | None) -> Constraint | None:
    if fields is None:
        return None
    for option, default in _OPTION_DEFAULTS.items():
        if getattr(fields, option) != default:
            raise bad_request(f"structured_outputs.{option} is not supported",
                              f"structured_outputs.{option}")
    spec = {"json": fields.json_, "regex": fields.regex, "choice": fields.choice,
            "grammar": fields.grammar, "json_object": fields.json_object}
    given = [kind for kind, value in spec.items() if value is not None and value is not False]
    param = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return make_constraint(param, **spec)
