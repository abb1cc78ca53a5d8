"""Server-sent-event chunks from `DELTA` outputs, for /v1/completions and /v1/chat/completions.

A stream gets `DELTA` outputs, each carrying only what is new, so a chunk is a delta passed on
as it comes, never a diff of cumulative copies (which would cost O(tokens²) on a long
generation). A chunk is sent only when a choice has something new: text, tokens (with their
logprobs, when asked for), or its finish reason, which goes out once (a choice that finished
before its siblings still appears, empty, in their later outputs). New tokens count even when
their text is held back (a possible stop-string prefix, part of a UTF-8 character, a possible
`<tool_call>`) or there is no tokenizer: a client sees a chunk per step, as with vLLM, and
`kvpool bench serve` measures inter-token latency between chunks. The engine never takes text
back, so the deltas concatenate to the whole text.

With `echo`, a choice's first chunk starts with its prompt (and, with logprobs, the prompt's
tokens' logprobs, from the engine's first output). A chat choice's text goes through its tool
plan's streamer: content as it comes, then each tool call as deltas, one chunk each (the
first with id, type and name, the next with the arguments), which concatenate to the calls of
the whole response. A stream's usage is counted from the deltas it saw (`Generation` sums
them): no single output carries all of a stream's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from kvpool.engine.requests.outputs import CompletionOutput, RequestOutput
from kvpool.openai.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaToolCall,
)
from kvpool.openai.tools.output import finish_reason, new_call_id
from kvpool.openai.tools.parser import ToolCallDelta, ToolCallStreamer
from kvpool.server.inputs import EngineInputs
from kvpool.server.responses import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    usage,
)

SSE_DONE = "data: [DONE]\n\n"


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def _is_finished(completion: CompletionOutput) -> bool:
    return completion.finish_reason is not None


def _new_deltas(
    output: RequestOutput, first_index: int, finished: set[int]
) -> list[tuple[int, CompletionOutput]]:
    """(choice index, delta) for each completion of `output` with something new to send; marks
    the finished ones, so that a finish reason goes out once."""
    deltas = []
    for completion in output.outputs:
        index = first_index + completion.index
        if index in finished:
            continue
        if not (completion.text or completion.token_ids or _is_finished(completion)):
            continue
        if _is_finished(completion):
            finished.add(index)
        deltas.append((index, completion))
    return deltas


@dataclass(slots=True)
class CompletionStreamer:
    """SSE chunks for /v1/completions with `stream: true`, from DELTA outputs."""

    response_id: str
    created: int
    model: str
    n: int
    num_top: int
    inputs: EngineInputs
    finished: set[int] = field(default_factory=set)  # choices whose finish reason was sent
    text_offsets: dict[int, int] = field(default_factory=dict)  # choice -> its next token's
    echoed: set[int] = field(default_factory=set)  # choices whose prompt was sent

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[str]:
        events = []
        for index, completion in _new_deltas(output, prompt_index * self.n, self.finished):
            text, logprobs = self._echo(index, prompt_index, output, completion)
            before = self.text_offsets.get(index, 0)
            if not self.inputs.is_echo_only:
                text += completion.text
                generated = completion_logprobs(completion, self.num_top,
                                                before + _length(logprobs))
                logprobs = _joined(logprobs, generated)
            self.text_offsets[index] = before + _length(logprobs)
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=completion.finish_reason,
                                      stop_reason=completion.stop_reason)
            events.append(sse(Completion(id=self.response_id, created=self.created,
                                         model=self.model, choices=[choice])))
        return events

    def _echo(self, index: int, prompt_index: int, output: RequestOutput,
              completion: CompletionOutput) -> tuple[str, CompletionLogprobs | None]:
        """What goes before the choice's first text: its prompt, with echo."""
        if not self.inputs.echo or index in self.echoed:
            return "", None
        self.echoed.add(index)
        prompt = self.inputs.prompts[prompt_index]
        if completion.logprobs is None or output.prompt_logprobs is None:
            return prompt.text or "", None
        return prompt.text or "", echo_logprobs(prompt, output.prompt_logprobs, self.num_top)

    def usage_chunk(self, finals: list[RequestOutput], num_completion_tokens: int) -> str:
        return sse(Completion(id=self.response_id, created=self.created, model=self.model,
                              choices=[], usage=usage(finals, num_completion_tokens)))


def _length(logprobs: CompletionLogprobs | None) -> int:
    """Characters the tokens of `logprobs` span (where the next token's text offset is)."""
    return 0 if logprobs is None else sum(len(token) for token in logprobs.tokens)


def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs | None
            ) -> CompletionLogprobs | None:
    if first is None or second is None:
        return second if first is None else first
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(first, name).extend(getattr(second, name))
    return first


@dataclass(slots=True)
class ChatStreamer:
    """SSE chunks for /v1/chat/completions with `stream: true`, from DELTA outputs."""

    response_id: str
    created: int
    model: str
    num_top: int
    inputs: EngineInputs
    finished: set[int] = field(default_factory=set)  # choices whose finish reason was sent
    readers: dict[int, ToolCallStreamer] = field(default_factory=dict)  # choice -> its reader
    num_calls: dict[int, int] = field(default_factory=dict)  # choice -> tool calls started

    def role_chunks(self, n: int) -> list[str]:
        """The first chunk of every choice: the assistant role and empty content."""
        return [self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant",
                                                                          content="")))
                for index in range(n)]

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[str]:
        """Chunks for one output (a chat request has one prompt: `prompt_index` is 0)."""
        events = []
        for index, completion in _new_deltas(output, prompt_index, self.finished):
            events += self._choice_chunks(index, completion)
        return events

    def _choice_chunks(self, index: int, completion: CompletionOutput) -> list[str]:
        reader = self._reader(index)
        piece = reader.feed(completion.text)
        is_done = _is_finished(completion)
        if is_done:
            tail = reader.finish()
            piece.content += tail.content
            piece.calls += tail.calls
            piece.reasoning += tail.reasoning
        calls = [self._tool_delta(index, delta) for delta in piece.calls]
        thinking = [ChatDelta(reasoning_content=piece.reasoning)] if piece.reasoning else []
        content = piece.content if piece.content or not (is_done or calls or thinking) else None
        deltas = [ChatDelta(content=content)] if content is not None else []
        deltas = thinking + deltas + [ChatDelta(tool_calls=[call]) for call in calls]
        if not deltas:
            deltas = [ChatDelta()]  # a last chunk with nothing new: it carries the finish
        reason = None
        if is_done:
            assert self.inputs.tool_plan is not None
            reason = finish_reason(self.inputs.tool_plan, self.num_calls.get(index, 0),
                                   completion.finish_reason)
        logprobs = chat_logprobs(completion, self.num_top)
        return [
            self._chunk(ChatChunkChoice(
                index=index, delta=delta, logprobs=logprobs if number == 0 else None,
                finish_reason=reason if number == len(deltas) - 1 else None,
                stop_reason=completion.stop_reason if number == len(deltas) - 1 else None,
            ))
            for number, delta in enumerate(deltas)
        ]

    def _reader(self, index: int) -> ToolCallStreamer:
        reader = self.readers.get(index)
        if reader is None:
            assert self.inputs.output_parser is not None
            reader = self.readers[index] = self.inputs.output_parser.streamer()
        return reader

    def _tool_delta(self, index: int, delta: ToolCallDelta) -> DeltaToolCall:
        if delta.name is None:
            return DeltaToolCall(index=delta.index,
                                 function=DeltaFunctionCall(arguments=delta.arguments))
        self.num_calls[index] = self.num_calls.get(index, 0) + 1
        return DeltaToolCall(index=delta.index, id=new_call_id(), type="function",
                             function=DeltaFunctionCall(name=delta.name,
                                                        arguments=delta.arguments))

    def usage_chunk(self, finals: list[RequestOutput], num_completion_tokens: int) -> str:
        return sse(ChatCompletionChunk(id=self.response_id, created=self.created,
                                       model=self.model, choices=[],
                                       usage=usage(finals, num_completion_tokens)))

    def _chunk(self, choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=self.response_id, created=self.created,
                                       model=self.model, choices=[choice]))
