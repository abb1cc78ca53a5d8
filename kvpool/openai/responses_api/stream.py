"""The Responses stream: one response's server-sent events, built from the pieces the chat
pipeline's output reader gives (`StreamPiece`: thinking, content, tool-call deltas).

    start()    response.created, response.in_progress
    feed()     per output item, in the order its text arrives:
                 response.output_item.added
                 reasoning | message:  response.content_part.added,
                                       response.reasoning_text.delta | output_text.delta, ...
                                       response.reasoning_text.done | output_text.done,
                                       response.content_part.done
                 function_call:        response.function_call_arguments.delta, ...,
                                       response.function_call_arguments.done
                 response.output_item.done
    finish()   the last item's done events, then response.completed, or response.incomplete
               (reason max_output_tokens) when the output was cut
    fail()     the open item's done events, then response.failed (the engine stopped)

Each event goes out as `event: <type>` and `data: <json>`, numbered by `sequence_number` from
0. An item stays open until text of another kind, or another call, arrives, or the output
ends; the items closed, ids and all, are those the final response carries, as the client's
stream helper checks. A reader gives thinking first, then content, then calls (the reasoning
parser splits the thinking off before the tool parser reads the answer, and tool parsers send
content before calls), so a stream's items are those `convert.output_items` builds from the
whole text. Deltas are passed on as they come; only the open item's text is kept, for its
done events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from kvpool.openai.responses_api.convert import (
    call_item,
    finished_response,
    item_id,
    message_item,
    reasoning_item,
)
from kvpool.openai.responses_api.protocol import (
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from kvpool.openai.tools.output import new_call_id
from kvpool.openai.tools.parser import StreamPiece, ToolCallDelta

ItemKind = Literal["reasoning", "message", "function_call"]
_TEXT_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


@dataclass(slots=True)
class _OpenItem:
    """The item being streamed: its text so far (a call's arguments, for a function call)."""

    kind: ItemKind
    id: str
    output_index: int
    call_id: str = ""
    name: str = ""
    text: str = ""

    def added(self) -> OutputItem:
        """The item as `output_item.added` announces it: in progress, nothing in it yet."""
        if self.kind == "reasoning":
            return ReasoningItem(id=self.id, content=[], status="in_progress")
        if self.kind == "message":
            return OutputMessage(id=self.id, content=[], status="in_progress")
        return call_item(self.id, self.call_id, self.name, "", "in_progress")

    def done(self, status: ItemStatus) -> OutputItem:
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, status)
        if self.kind == "message":
            return message_item(self.id, self.text, status)
        return call_item(self.id, self.call_id, self.name, self.text, status)

    def part(self) -> OutputText | ReasoningText:
        if self.kind == "reasoning":
            return ReasoningText(text=self.text)
        return OutputText(text=self.text)

    def where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.output_index}


@dataclass
class ResponseEventStream:
    """The events of the response that `shell` (`convert.response_shell`) begins."""

    shell: ResponseObject
    items: list[OutputItem] = field(default_factory=list)  # closed, in output order
    open: _OpenItem | None = None
    num_events: int = 0

    @property
    def reasoning(self) -> str:
        """The thinking streamed so far (for usage's reasoning tokens)."""
        texts = [item.content[0].text for item in self.items if isinstance(item, ReasoningItem)]
        if self.open is not None and self.open.kind == "reasoning":
            texts.append(self.open.text)
        return "".join(texts)

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.shell),
                self._event("response.in_progress", response=self.shell)]

    def feed(self, piece: StreamPiece) -> list[str]:
        events = []
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            events += self._text("message", piece.content)
        for delta in piece.calls:
            events += self._call(delta)
        return events

    def finish(self, is_cut: bool, usage: ResponseUsage) -> list[str]:
        """The end: the last item closed (`incomplete` if cut), an empty message if nothing
        was output, then the final response."""
        status: ItemStatus = "incomplete" if is_cut else "completed"
        events = self._close(status)
        if not self.items:
            events += self._open("message") + self._close(status)
        final = finished_response(self.shell, self.items, is_cut, usage)
        kind = "response.incomplete" if is_cut else "response.completed"
        return [*events, self._event(kind, response=final)]

    def fail(self, message: str) -> list[str]:
        events = self._close("incomplete")
        failed = self.shell.model_copy(update={
            "status": "failed", "output": self.items,
            "error": ResponseError(code="server_error", message=message)})
        return [*events, self._event("response.failed", response=failed)]

    def _text(self, kind: ItemKind, text: str) -> list[str]:
        events = []
        if self.open is None or self.open.kind != kind:
            events += self._close("completed") + self._open(kind)
        assert self.open is not None
        self.open.text += text
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(f"{_TEXT_EVENTS[kind]}.delta", **self.open.where(),
                                  content_index=0, delta=text, **extra))
        return events

    def _call(self, delta: ToolCallDelta) -> list[str]:
        events = []
        if delta.name is not None:  # a new call
            events += self._close("completed")
            events += self._open("function_call", call_id=new_call_id(), name=delta.name)
        assert self.open is not None and self.open.kind == "function_call"
        if delta.arguments:
            self.open.text += delta.arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      **self.open.where(), delta=delta.arguments))
        return events

    def _open(self, kind: ItemKind, **call: str) -> list[str]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = self.open = _OpenItem(kind, item_id(prefix), len(self.items), **call)
        events = [self._event("response.output_item.added", output_index=item.output_index,
                              item=item.added())]
        if kind != "function_call":
            events.append(self._event("response.content_part.added", **item.where(),
                                      content_index=0, part=item.part()))
        return events

    def _close(self, status: ItemStatus) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **item.where(),
                                  arguments=item.text)]
        else:
            extra = {"logprobs": []} if item.kind == "message" else {}
            events = [
                self._event(f"{_TEXT_EVENTS[item.kind]}.done", **item.where(), content_index=0,
                            text=item.text, **extra),
                self._event("response.content_part.done", **item.where(), content_index=0,
                            part=item.part()),
            ]
        done = item.done(status)
        self.items.append(done)
        events.append(self._event("response.output_item.done", output_index=item.output_index,
                                  item=done))
        return events

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.num_events}
        data.update({name: value.model_dump() if isinstance(value, BaseModel) else value
                     for name, value in fields.items()})
        self.num_events += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"
