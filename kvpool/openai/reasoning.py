"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): a reasoning model's thinking,
`<think> ... </think>`, split from its answer.

    deepseek_r1   DeepSeek-R1 and its distills: their chat template opens the thinking in
                  the prompt, so the output starts inside it (a leading "<think>" is dropped
                  if the model writes one anyway) and thinks until "</think>"; an output cut
                  before it is all thinking
    qwen3         Qwen3: the output thinks only if it opens with "<think>" (with
                  `enable_thinking: false` the template closes an empty thinking in the
                  prompt, and the output is all answer)

The thinking goes to `reasoning_content`, the rest to the answer, which the tool-call parser
then reads (`ThinkingFirst`). A `Splitter` does it piece by piece for a stream, holding back
only text that may still be the start of a tag, so the pieces of a stream concatenate to the
split of the whole text (`ToolParser.extract` runs the same splitter over it).

Each parser's `thinking` is its syntax as the engine reads it (`kvpool.engine.
structured_outputs.Thinking`): a constrained request's grammar starts after the thinking, at
the text the split makes the answer (both find the markers in the text, however tokenized).
"""

from __future__ import annotations

from abc import ABC
from typing import ClassVar

from kvpool.engine.structured_outputs import Thinking
from kvpool.openai.tools.parser import StreamPiece, ToolCallStreamer, ToolParser

START, END = "<think>", "</think>"
_OPENING, _THINKING, _ANSWER = "opening", "thinking", "answer"


class ReasoningParser(ABC):
    """A model family's thinking syntax (module docstring)."""

    name: ClassVar[str]
    # The markers; `start` None: the output begins inside the thinking, tag or not.
    thinking: ClassVar[Thinking]

    def splitter(self) -> Splitter:
        return Splitter(self.thinking.start is None)


class DeepSeekR1(ReasoningParser):
    name = "deepseek_r1"
    thinking = Thinking(end=END)


class Qwen3(ReasoningParser):
    name = "qwen3"
    thinking = Thinking(end=END, start=START)


class Splitter:
    """One completion's text, piece by piece: (thinking, answer) of each piece."""

    def __init__(self, starts_thinking: bool) -> None:
        self.starts_thinking = starts_thinking
        self.state = _OPENING
        self.pending = ""  # text held back: it may still be (part of) a tag

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        thinking, answer = "", ""
        if self.state == _OPENING:
            if START.startswith(self.pending):  # "<thi" may still become the tag
                return "", ""
            opens = self.pending.startswith(START)
            if opens:
                self.pending = self.pending[len(START):]
            self.state = _THINKING if opens or self.starts_thinking else _ANSWER
        if self.state == _THINKING:
            end = self.pending.find(END)
            if end < 0:
                keep = _partial_suffix(self.pending, END)
                thinking = self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return thinking, ""
            thinking = self.pending[:end]
            self.pending = self.pending[end + len(END):]
            self.state = _ANSWER
        answer, self.pending = self.pending, ""
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back (an unfinished tag is text)."""
        pending, self.pending = self.pending, ""
        thinking = self.state == _THINKING or (self.state == _OPENING and self.starts_thinking)
        return (pending, "") if thinking else ("", pending)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ThinkingFirst(ToolParser):
    """The thinking split off first (`reasoning`), then `inner` (the tool plan's reader) on
    the answer."""

    name = "thinking-first"

    def __init__(self, reasoning: ReasoningParser, inner: ToolParser) -> None:
        self.reasoning = reasoning
        self.inner = inner
        self.needs_special_tokens = inner.needs_special_tokens

    def streamer(self) -> ToolCallStreamer:
        return _ThinkingFirstStreamer(self.reasoning.splitter(), self.inner.streamer())


class _ThinkingFirstStreamer(ToolCallStreamer):
    def __init__(self, splitter: Splitter, inner: ToolCallStreamer) -> None:
        self.splitter = splitter
        self.inner = inner

    def feed(self, text: str) -> StreamPiece:
        thinking, answer = self.splitter.feed(text)
        piece = self.inner.feed(answer)
        piece.reasoning = thinking + piece.reasoning
        return piece

    def finish(self) -> StreamPiece:
        thinking, answer = self.splitter.finish()
        piece = self.inner.feed(answer)
        tail = self.inner.finish()
        return StreamPiece(content=piece.content + tail.content, calls=piece.calls + tail.calls,
                           reasoning=thinking)


_PARSERS: dict[str, type[ReasoningParser]] = {parser.name: parser
                                               for parser in (DeepSeekR1, Qwen3)}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ValueError naming the known ones otherwise."""
    try:
        return _PARSERS[name]()
    except KeyError:
        known = ", ".join(reasoning_parser_names())
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})") from None
