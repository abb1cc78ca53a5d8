"""The Hermes tool-call syntax (NousResearch Hermes 2 Pro, Qwen 2.5/3 and many others):

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first `<tool_call>`. Each `<tool_call>...</tool_call>` region
holds one JSON object with a `name` and its `arguments` (an object; `parameters` is read too,
as some models write it); the last region may be unterminated when the output ends. A region
that is not such an object is dropped. If no region holds a valid call, the whole text is
content, so nothing the model wrote is lost.

`extract` (the interface's) runs the streamer over the whole text, so the two agree: a stream
sends content until a `<tool_call>` begins (holding back a suffix that may be the start of
one), then each call once its region closes (name first, then its arguments), and at the end
an unterminated last region, or, if no call was found, the held-back text as content.
"""

from __future__ import annotations

import json

from kvpool.openai.tools.parser import (
    ParsedToolCall,
    StreamPiece,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
    register_tool_parser,
)

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser
class HermesToolParser(ToolParser):
    name = "hermes"
    needs_special_tokens = True

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer()


class HermesStreamer(ToolCallStreamer):
    """One completion's Hermes parse, fed piece by piece."""

    def __init__(self) -> None:
        self._text = ""
        self._num_sent = 0  # characters of content sent
        self._first_start: int | None = None  # where the first <tool_call> begins
        self._scan = 0  # where the next region is looked for
        self._num_calls = 0

    def feed(self, text: str) -> StreamPiece:
        self._text += text
        piece = StreamPiece()
        if self._first_start is None:
            start = self._text.find(START, self._num_sent)
            if start == -1:
                sendable = len(self._text) - _partial_suffix(self._text, START)
                piece.content = self._take_content(sendable)
                return piece
            piece.content = self._take_content(start)
            self._first_start = self._scan = start
        while (start := self._text.find(START, self._scan)) != -1:
            end = self._text.find(END, start + len(START))
            if end == -1:
                break
            self._scan = end + len(END)
            self._emit(self._text[start + len(START):end], piece)
        return piece

    def finish(self) -> StreamPiece:
        piece = StreamPiece()
        if self._first_start is not None:
            start = self._text.find(START, self._scan)
            if start != -1:  # the output ended inside a region
                body = self._text[start + len(START):]
                self._emit(body[:len(body) - _partial_suffix(body, END)], piece)
                self._scan = len(self._text)
            if self._num_calls > 0:
                return piece
        piece.content = self._take_content(len(self._text))
        return piece

    def _take_content(self, upto: int) -> str:
        content = self._text[self._num_sent:upto]
        self._num_sent = max(self._num_sent, upto)
        return content

    def _emit(self, body: str, piece: StreamPiece) -> None:
        call = parse_call(body)
        if call is None:
            return
        piece.calls.append(ToolCallDelta(self._num_calls, call.name, ""))
        piece.calls.append(ToolCallDelta(self._num_calls, None, call.arguments))
        self._num_calls += 1


def parse_call(body: str) -> ParsedToolCall | None:
    """A region's call, or None if it is not `{"name": str, "arguments": object}`."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # already a JSON string: kept as written if an object
        try:
            is_object = isinstance(json.loads(arguments), dict)
        except ValueError:
            is_object = False
        return ParsedToolCall(value["name"], arguments) if is_object else None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (shorter than `tag`)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
