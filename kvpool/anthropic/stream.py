"""A message's stream: the DELTA outputs of its one completion as Anthropic's events.

    message_start                      with the first output (it carries the cache hit)
    content_block_start  index i       thinking, text or tool_use (a call's id and name)
    content_block_delta  index i       thinking_delta / text_delta / input_json_delta
    content_block_stop   index i       when the next block starts, or the output ends
    message_delta                      stop_reason, stop_sequence, usage.output_tokens
    message_stop

The text goes through the request's own reader (`inputs.output_parser`, a `ToolCallStreamer`),
so the blocks are those a whole response has, in the same order, and their deltas
concatenate to its blocks' text and tool inputs. Only one block is open at a time: a reader
sends thinking before the answer and a call's arguments right after its name. A failed
generation ends with an `error` event instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from kvpool.anthropic.convert import new_tool_use_id, stop_reason, usage
from kvpool.anthropic.protocol import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStartEvent,
    MessageStopEvent,
    StopReason,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.openai.tools.parser import StreamPiece, ToolCallStreamer


def sse_event(event: BaseModel) -> str:
    """One server-sent event, named by the body's `type` as Anthropic names its events."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"  # type: ignore[attr-defined]


@dataclass(slots=True)
class MessageStreamer:
    """The events of one message, from the DELTA outputs of its completion."""

    response_id: str
    model: str
    reader: ToolCallStreamer
    stop_sequences: list[str] | None
    num_blocks: int = 0
    open_type: str | None = None  # the type of the open block (the last started), if any
    num_calls: int = 0
    stop: tuple[StopReason, str | None] = ("end_turn", None)
    is_started: bool = False
    events: list[str] = field(default_factory=list)  # what the current call will send

    def feed(self, output: RequestOutput) -> list[str]:
        """The events one output adds (message_start first, with the first output)."""
        if not self.is_started:
            self.is_started = True
            start = Message(id=self.response_id, model=self.model, content=[],
                            stop_reason=None, usage=usage(output, 0))
            self._send(MessageStartEvent(message=start))
        completion = output.outputs[0]
        piece = self.reader.feed(completion.text)
        if completion.finish_reason is not None:
            piece = _joined(piece, self.reader.finish())
        self._add(piece)
        if completion.finish_reason is not None:
            self._close()
            self.stop = stop_reason(completion, self.num_calls, self.stop_sequences)
        return self._flush()

    def end(self, num_output_tokens: int) -> list[str]:
        """The closing events, once the outputs are over."""
        self._close()
        reason, sequence = self.stop
        self._send(MessageDeltaEvent(
            delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
            usage=MessageDeltaUsage(output_tokens=num_output_tokens)))
        self._send(MessageStopEvent())
        return self._flush()

    def _add(self, piece: StreamPiece) -> None:
        if piece.reasoning:
            self._delta(ThinkingBlock(thinking=""), ThinkingDelta(thinking=piece.reasoning))
        if piece.content:
            self._delta(TextBlock(text=""), TextDelta(text=piece.content))
        for call in piece.calls:
            if call.name is not None:
                self.num_calls += 1
                self._open(ToolUseBlock(id=new_tool_use_id(), name=call.name, input={}))
            if call.arguments:
                assert self.open_type == "tool_use", "a call's arguments follow its name"
                self._delta(None, InputJsonDelta(partial_json=call.arguments))

    def _delta(self, block: TextBlock | ThinkingBlock | None,
               delta: TextDelta | ThinkingDelta | InputJsonDelta) -> None:
        """`delta` into the open block, after opening `block` if it is of another type."""
        if block is not None and block.type != self.open_type:
            self._open(block)
        self._send(ContentBlockDeltaEvent(index=self.num_blocks - 1, delta=delta))

    def _open(self, block: ContentBlock) -> None:
        self._close()
        self._send(ContentBlockStartEvent(index=self.num_blocks, content_block=block))
        self.num_blocks += 1
        self.open_type = block.type

    def _close(self) -> None:
        if self.open_type is not None:
            self._send(ContentBlockStopEvent(index=self.num_blocks - 1))
            self.open_type = None

    def _send(self, event: BaseModel) -> None:
        self.events.append(sse_event(event))

    def _flush(self) -> list[str]:
        events, self.events = self.events, []
        return events


def _joined(first: StreamPiece, second: StreamPiece) -> StreamPiece:
    return StreamPiece(content=first.content + second.content, calls=first.calls + second.calls,
                       reasoning=first.reasoning + second.reasoning)
