"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list
of strings, or a grammar (vLLM's `StructuredOutputsParams`, same names and meanings).

Exactly one kind is given. The spec is only a description: compiling it into a grammar and
keeping per-sequence matcher state is `kvpool.engine.sampling.grammar`'s job. `key` is the spec in a
canonical, hashable form, so equal schemas share one compiled grammar however their JSON was
spelled (whitespace, a dict or its text). A schema's key order is kept: it is the order the
object's properties are generated in, so it is part of what the schema asks for.

`thinking` (optional) says that the output of a reasoning model thinks before it answers and
that the constraint holds the answer only: the grammar starts after the thinking's end marker
(`Thinking`; the server sets it from its `--reasoning-parser`). It is not part of `key`: the
grammar is the same, only where it starts differs (`kvpool.engine.sampling.after_thinking`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpool.engine.errors import InvalidRequestError

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class Thinking:
    """Where a reasoning model's output thinks, as text markers (any tokenization of them
    counts): the constraint holds only what follows the first `end`.

    `start` None: the output begins inside the thinking (DeepSeek-R1, whose chat template
    opens it in the prompt) and is unconstrained until `end`. `start` given: thinking is
    optional (Qwen3): an output that opens with `start` thinks until `end`, any other is
    constrained from its first token; while its text can still become `start`, both are
    allowed."""

    end: str = "</think>"
    start: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.end, str) and self.end):
            raise InvalidRequestError("thinking.end must be a non-empty string",
                                      "structured_outputs.thinking.end")
        if not (self.start is None or (isinstance(self.start, str) and self.start)):
            raise InvalidRequestError("thinking.start must be None or a non-empty string",
                                      "structured_outputs.thinking.start")


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """One constraint on the output; `json` is a JSON schema (a dict, or its JSON text)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF / Lark-like, as xgrammar reads it)
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    thinking: Thinking | None = None  # the grammar holds only the answer after the thinking

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if self._value(kind) is not None]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs takes exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}"
                f" (got {len(given)})", "structured_outputs")
        self._check_value(given[0])
        if not (self.thinking is None or isinstance(self.thinking, Thinking)):
            raise InvalidRequestError("thinking must be a Thinking", "structured_outputs.thinking")

    def _value(self, kind: str) -> Any:
        value = getattr(self, kind)
        return None if kind == "json_object" and not value else value

    def _check_value(self, kind: str) -> None:
        value = self._value(kind)
        param = f"structured_outputs.{kind}"
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise InvalidRequestError("the JSON schema is not valid JSON", param) from error
        if kind == "json" and not isinstance(value, (dict, bool)):
            raise InvalidRequestError("the JSON schema must be an object", param)
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise InvalidRequestError(f"{kind} must be a non-empty string", param)
        if kind == "choice" and not (
            value and all(isinstance(item, str) and item for item in value)
        ):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings",
                                      param)

    @property
    def kind(self) -> str:
        """Which of `STRUCTURED_OUTPUT_KINDS` this spec is."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if self._value(kind) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints have equal keys."""
        kind = self.kind
        value = self._value(kind)
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return kind, json.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(value)
        if kind == "json_object":
            return kind, ""
        return kind, value

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, StructuredOutputsParams) and self.key == other.key
                and self.thinking == other.thinking)

    def __hash__(self) -> int:
        return hash((self.key, self.thinking))
