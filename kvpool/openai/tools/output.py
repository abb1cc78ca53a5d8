"""How a chat completion's text is read, by tool plan: a `ToolParser` per mode.

    none       all content                    PlainOutput
    auto       the --tool-call-parser's read  the registered parser (first call only with
                                              parallel_tool_calls false: FirstCallOnly)
    named      the text is the arguments      NamedFunctionOutput: the call starts at once,
                                              its arguments stream as they come
    required   a JSON array of calls          RequiredCallsOutput: parsed when it ends
                                              (unparsable, e.g. cut by max_tokens: content)

All of them are streamers underneath, so a stream and a whole response read the same text
the same way. A choice that called a tool under `auto` or `required` and stopped on its own
finishes with "tool_calls"; a named call keeps "stop", as OpenAI answers.
"""

from __future__ import annotations

import json
import uuid

from kvpool.openai.tools.choice import ToolPlan
from kvpool.openai.tools.parser import (
    StreamPiece,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
)


def output_parser(plan: ToolPlan, parser: ToolParser) -> ToolParser:
    """The reader of this plan's outputs; `parser` is the server's --tool-call-parser."""
    if plan.mode == "none":
        return PlainOutput()
    if plan.mode == "auto":
        return parser if plan.is_parallel else FirstCallOnly(parser)
    if plan.mode == "named":
        assert plan.function_name is not None
        return NamedFunctionOutput(plan.function_name)
    return RequiredCallsOutput()


def finish_reason(plan: ToolPlan, num_calls: int, reason: str | None) -> str | None:
    if num_calls and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class PlainOutput(ToolParser):
    name = "none"

    def streamer(self) -> ToolCallStreamer:
        return _PlainStreamer()


class _PlainStreamer(ToolCallStreamer):
    def feed(self, text: str) -> StreamPiece:
        return StreamPiece(content=text)

    def finish(self) -> StreamPiece:
        return StreamPiece()


class FirstCallOnly(ToolParser):
    """Another parser's read, keeping only its first call (parallel_tool_calls: false)."""

    name = "first-call-only"

    def __init__(self, inner: ToolParser) -> None:
        self.inner = inner

    def streamer(self) -> ToolCallStreamer:
        return _FirstCallStreamer(self.inner.streamer())


class _FirstCallStreamer(ToolCallStreamer):
    def __init__(self, inner: ToolCallStreamer) -> None:
        self.inner = inner

    def feed(self, text: str) -> StreamPiece:
        return self._first(self.inner.feed(text))

    def finish(self) -> StreamPiece:
        return self._first(self.inner.finish())

    @staticmethod
    def _first(piece: StreamPiece) -> StreamPiece:
        piece.calls = [delta for delta in piece.calls if delta.index == 0]
        return piece


class NamedFunctionOutput(ToolParser):
    """The output is the named function's arguments (decoding is held to its schema)."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def streamer(self) -> ToolCallStreamer:
        return _NamedStreamer(self.function_name)


class _NamedStreamer(ToolCallStreamer):
    def __init__(self, function_name: str) -> None:
        self.function_name = function_name
        self.has_started = False

    def feed(self, text: str) -> StreamPiece:
        piece = StreamPiece(calls=self._start())
        if text:
            piece.calls.append(ToolCallDelta(0, None, text))
        return piece

    def finish(self) -> StreamPiece:
        return StreamPiece(calls=self._start())

    def _start(self) -> list[ToolCallDelta]:
        if self.has_started:
            return []
        self.has_started = True
        return [ToolCallDelta(0, self.function_name, "")]


class RequiredCallsOutput(ToolParser):
    """The output is `[{"name": ..., "parameters": {...}}, ...]` (decoding is held to it)."""

    name = "required"

    def streamer(self) -> ToolCallStreamer:
        return _RequiredStreamer()


class _RequiredStreamer(ToolCallStreamer):
    def __init__(self) -> None:
        self.text = ""

    def feed(self, text: str) -> StreamPiece:
        self.text += text
        return StreamPiece()

    def finish(self) -> StreamPiece:
        try:
            calls = json.loads(self.text)
        except ValueError:
            return StreamPiece(content=self.text)
        if not isinstance(calls, list) or not calls or not all(map(_is_call, calls)):
            return StreamPiece(content=self.text)
        piece = StreamPiece()
        for index, call in enumerate(calls):
            piece.calls.append(ToolCallDelta(index, call["name"], ""))
            arguments = json.dumps(call.get("parameters", {}), ensure_ascii=False)
            piece.calls.append(ToolCallDelta(index, None, arguments))
        return piece


def _is_call(call: object) -> bool:
    return (isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("parameters", {}), dict))
