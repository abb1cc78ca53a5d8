"""From engine outputs to OpenAI bodies: whole responses, and server-sent-event chunks.

The server asks the engine for the outputs each body needs (`inputs.py` sets the output kind):
a whole response is built from one `FINAL_ONLY` output per prompt, which carries everything; a
stream gets `DELTA` outputs, each carrying only what is new, so a chunk is a delta passed on as
it comes, never a diff of cumulative copies (which would cost O(tokens²) on a long generation).
A chunk is sent only when a choice has something new: text, tokens (with their logprobs, when
asked for), or its finish reason, which goes out once (a choice that finished before its
siblings still appears, empty, in their later outputs). New tokens count even when their text
is held back (a possible stop-string prefix, part of a UTF-8 character) or there is no
tokenizer: a client sees one chunk per step, as with vLLM, and `kvpool bench serve` measures
inter-token latency between chunks. The engine never takes text back, so the deltas
concatenate to the whole text.

Choice numbering follows OpenAI: with several prompts, prompt i's completion j is choice
`i * n + j`. A stream's usage is counted from the deltas it saw (`Generation` sums them):
no single output carries all of a stream's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from kvpool.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvpool.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

SSE_DONE = "data: [DONE]\n\n"


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def usage(finals: list[RequestOutput], num_completion_tokens: int | None = None) -> Usage:
    """Usage of the prompts' final outputs; `num_completion_tokens` is counted by the caller
    for a stream (whose final outputs are deltas), else taken from the outputs themselves."""
    num_prompt = sum(len(output.prompt_token_ids) for output in finals)
    if num_completion_tokens is None:
        num_completion_tokens = sum(len(c.token_ids) for output in finals for c in output.outputs)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(output.num_cached_tokens for output in finals)
        ),
    )


# ------------------------------------------------------------------ logprobs
def _token_text(token_id: int, entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"token_id:{token_id}"


def _ranked(entries: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` most likely tokens of a step, best first."""
    ranked = sorted(entries.items(), key=lambda item: (item[1].rank, -item[1].logprob))
    return [(token_id, entry) for token_id, entry in ranked if entry.rank <= num_top][:num_top]


def completion_logprobs(
    completion: CompletionOutput, num_top: int, text_offset: int
) -> CompletionLogprobs | None:
    """Logprobs of the completion's tokens, `text_offset` being where its first one begins."""
    if completion.logprobs is None:
        return None
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        token = _token_text(token_id, entries[token_id])
        result.tokens.append(token)
        result.token_logprobs.append(entries[token_id].logprob)
        top = {_token_text(tid, entry): entry.logprob for tid, entry in _ranked(entries, num_top)}
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(completion: CompletionOutput, num_top: int) -> ChatLogprobs | None:
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        token = _token_text(token_id, entries[token_id])
        top = [_top_logprob(_token_text(tid, entry), entry) for tid, entry in
               _ranked(entries, num_top)]
        content.append(TokenLogprob(**_top_logprob(token, entries[token_id]).model_dump(),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def _top_logprob(token: str, entry: Logprob) -> TopLogprob:
    token_bytes = list(token.encode("utf-8", "replace"))
    return TopLogprob(token=token, logprob=entry.logprob, bytes=token_bytes)


# ------------------------------------------------------------ whole responses
def completion_response(
    response_id: str, created: int, model: str, outputs: list[RequestOutput], n: int,
    num_top: int,
) -> Completion:
    choices = [
        CompletionChoice(
            index=prompt_index * n + completion.index,
            text=completion.text,
            logprobs=completion_logprobs(completion, num_top, 0),
            finish_reason=completion.finish_reason,
        )
        for prompt_index, output in enumerate(outputs)
        for completion in output.outputs
    ]
    choices.sort(key=lambda choice: choice.index)
    return Completion(id=response_id, created=created, model=model, choices=choices,
                      usage=usage(outputs))


def chat_response(
    response_id: str, created: int, model: str, output: RequestOutput, num_top: int
) -> ChatCompletion:
    choices = [
        ChatChoice(
            index=completion.index,
            message=AssistantMessage(content=completion.text),
            logprobs=chat_logprobs(completion, num_top),
            finish_reason=completion.finish_reason,
        )
        for completion in output.outputs
    ]
    return ChatCompletion(id=response_id, created=created, model=model, choices=choices,
                          usage=usage([output]))


# ------------------------------------------------------------------ streams
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
        if not (completion.text or completion.token_ids or completion.finished):
            continue
        if completion.finished:
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
    finished: set[int] = field(default_factory=set)  # choices whose finish reason was sent
    text_offsets: dict[int, int] = field(default_factory=dict)  # choice -> its next token's

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[str]:
        events = []
        for index, completion in _new_deltas(output, prompt_index * self.n, self.finished):
            offset = self.text_offsets.get(index, 0)
            logprobs = completion_logprobs(completion, self.num_top, offset)
            if logprobs is not None:
                self.text_offsets[index] = offset + sum(len(token) for token in logprobs.tokens)
            choice = CompletionChoice(index=index, text=completion.text, logprobs=logprobs,
                                      finish_reason=completion.finish_reason)
            events.append(sse(Completion(id=self.response_id, created=self.created,
                                         model=self.model, choices=[choice])))
        return events

    def usage_chunk(self, finals: list[RequestOutput], num_completion_tokens: int) -> str:
        return sse(Completion(id=self.response_id, created=self.created, model=self.model,
                              choices=[], usage=usage(finals, num_completion_tokens)))


@dataclass(slots=True)
class ChatStreamer:
    """SSE chunks for /v1/chat/completions with `stream: true`, from DELTA outputs."""

    response_id: str
    created: int
    model: str
    num_top: int
    finished: set[int] = field(default_factory=set)  # choices whose finish reason was sent

    def role_chunks(self, n: int) -> list[str]:
        """The first chunk of every choice: the assistant role and empty content."""
        return [self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant",
                                                                          content="")))
                for index in range(n)]

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[str]:
        """Chunks for one output (a chat request has one prompt: `prompt_index` is 0)."""
        events = []
        for index, completion in _new_deltas(output, prompt_index, self.finished):
            text = completion.text
            choice = ChatChunkChoice(
                index=index,
                delta=ChatDelta(content=text) if text or not completion.finished else ChatDelta(),
                logprobs=chat_logprobs(completion, self.num_top),
                finish_reason=completion.finish_reason,
            )
            events.append(self._chunk(choice))
        return events

    def usage_chunk(self, finals: list[RequestOutput], num_completion_tokens: int) -> str:
        return sse(ChatCompletionChunk(id=self.response_id, created=self.created,
                                       model=self.model, choices=[],
                                       usage=usage(finals, num_completion_tokens)))

    def _chunk(self, choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=self.response_id, created=self.created,
                                       model=self.model, choices=[choice]))
