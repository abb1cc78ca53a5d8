"""The tool-call parser interface and its registry (`--tool-call-parser NAME`).

A parser reads a model's raw output text and splits it into the content meant for the user
and the tool calls it contains, in the model's own syntax (Hermes: `<tool_call>{...}
</tool_call>`). `extract` does it for a whole text; `streamer()` gives an object that does the
same text piece by piece, for a stream. The two must agree: the pieces a streamer sends
concatenate to exactly what `extract` returns for the whole text (same content, same calls,
same arguments strings), so a streamed reply reassembles to the non-streamed one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the `index`-th call: the first piece has its name (and so starts the
    call), later ones only more arguments text."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class StreamPiece:
    """What one piece of output text adds: content for the user, tool-call pieces, and
    thinking (`kvpool.openai.reasoning`, with a reasoning parser)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A whole output read: its thinking (None: none), content (None: none) and calls."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedToolCall]


class ToolCallStreamer(ABC):
    """Parses one completion's text as it arrives."""

    @abstractmethod
    def feed(self, text: str) -> StreamPiece:
        """The next piece of output text; returns what can be sent now. Text that might
        still turn out to be part of a call is held back."""

    @abstractmethod
    def finish(self) -> StreamPiece:
        """The output ended: whatever was held back, as content or calls."""


class ToolParser(ABC):
    """A model family's tool-call syntax (or, for the constrained tool choices, the JSON the
    output is held to). `extract` runs the streamer over the whole text, so the two agree by
    construction."""

    name: ClassVar[str]
    # Tool-call markers may be special tokens in some models' vocabularies (vLLM's hermes
    # parser turns skip_special_tokens off for the same reason).
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh streaming parser for one completion."""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a whole output; content None when there is none."""
        parsed = self.read(text)
        return parsed.content, parsed.calls

    def read(self, text: str) -> ParsedOutput:
        """A whole output's thinking, content and calls."""
        streamer = self.streamer()
        return read_pieces([streamer.feed(text), streamer.finish()])


def assemble(pieces: list[StreamPiece]) -> tuple[str | None, list[ParsedToolCall]]:
    """What a sequence of stream pieces amounts to: the content and the whole calls."""
    parsed = read_pieces(pieces)
    return parsed.content, parsed.calls


def read_pieces(pieces: list[StreamPiece]) -> ParsedOutput:
    """What a sequence of stream pieces amounts to: thinking, content and the whole calls."""
    reasoning = "".join(piece.reasoning for piece in pieces)
    content = "".join(piece.content for piece in pieces)
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in (delta for piece in pieces for delta in piece.calls):
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    calls = [ParsedToolCall(names[index], arguments[index]) for index in sorted(names)]
    return ParsedOutput(reasoning or None, content or None, calls)


_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(parser: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: make `parser` available under its `name`."""
    _PARSERS[parser.name] = parser
    return parser


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """The registered parser called `name`; ValueError naming the known ones otherwise."""
    try:
        return _PARSERS[name]()
    except KeyError:
        known = ", ".join(tool_parser_names())
        raise ValueError(f"unknown tool call parser {name!r} (known: {known})") from None
