"""From engine outputs to OpenAI bodies: whole responses, and server-sent-event chunks.

Engine outputs are cumulative (all text and tokens so far); a `StreamProgress` remembers, per
choice, how much has been sent, so each chunk carries only the new text, the new tokens'
logprobs and, once, the finish reason. The engine never takes text back (it holds back a
possible stop-string prefix), so a delta is always a plain suffix.

Choice numbering follows OpenAI: with several prompts, prompt i's completion j is choice
`i * n + j`.
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


def usage(outputs: list[RequestOutput]) -> Usage:
    num_prompt = sum(len(output.prompt_token_ids) for output in outputs)
    num_completion = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(output.num_cached_tokens for output in outputs)
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
    completion: CompletionOutput, start: int, end: int, num_top: int, text_offset: int
) -> CompletionLogprobs | None:
    """Logprobs of tokens start..end-1, `text_offset` being where token `start` begins."""
    if completion.logprobs is None:
        return None
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entries in zip(completion.token_ids[start:end], completion.logprobs[start:end],
                                 strict=True):
        token = _token_text(token_id, entries[token_id])
        result.tokens.append(token)
        result.token_logprobs.append(entries[token_id].logprob)
        top = {_token_text(tid, entry): entry.logprob for tid, entry in _ranked(entries, num_top)}
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(
    completion: CompletionOutput, start: int, end: int, num_top: int
) -> ChatLogprobs | None:
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(completion.token_ids[start:end], completion.logprobs[start:end],
                                 strict=True):
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
            logprobs=completion_logprobs(completion, 0, len(completion.token_ids), num_top, 0),
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
            logprobs=chat_logprobs(completion, 0, len(completion.token_ids), num_top),
            finish_reason=completion.finish_reason,
        )
        for completion in output.outputs
    ]
    return ChatCompletion(id=response_id, created=created, model=model, choices=choices,
                          usage=usage([output]))


# ------------------------------------------------------------------ streams
@dataclass(slots=True)
class _ChoiceProgress:
    num_chars: int = 0  # text sent
    num_tokens: int = 0  # tokens whose logprobs were sent
    is_finished: bool = False


@dataclass(slots=True)
class StreamProgress:
    """What each choice of a stream has been sent so far."""

    choices: dict[int, _ChoiceProgress] = field(default_factory=dict)

    def advance(self, index: int, completion: CompletionOutput) -> tuple[str, int, int] | None:
        """(new text, first new token, end) since the last call, or None if nothing is new."""
        progress = self.choices.setdefault(index, _ChoiceProgress())
        if progress.is_finished:
            return None
        text = completion.text[progress.num_chars:]
        start, end = progress.num_tokens, len(completion.token_ids)
        if not text and start == end and not completion.finished:
            return None
        progress.num_chars += len(text)
        progress.num_tokens = end
        progress.is_finished = completion.finished
        return text, start, end


@dataclass(slots=True)
class CompletionStreamer:
    """SSE chunks for /v1/completions with `stream: true`."""

    response_id: str
    created: int
    model: str
    n: int
    num_top: int
    progress: StreamProgress = field(default_factory=StreamProgress)
    text_offsets: dict[int, int] = field(default_factory=dict)

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[str]:
        events = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            delta = self.progress.advance(index, completion)
            if delta is None:
                continue
            text, start, end = delta
            offset = self.text_offsets.get(index, 0)
            logprobs = completion_logprobs(completion, start, end, self.num_top, offset)
            if logprobs is not None:
                self.text_offsets[index] = offset + sum(len(token) for token in logprobs.tokens)
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=completion.finish_reason)
            events.append(sse(Completion(id=self.response_id, created=self.created,
                                         model=self.model, choices=[choice])))
        return events

    def usage_chunk(self, outputs: list[RequestOutput]) -> str:
        return sse(Completion(id=self.response_id, created=self.created, model=self.model,
                              choices=[], usage=usage(outputs)))


@dataclass(slots=True)
class ChatStreamer:
    """SSE chunks for /v1/chat/completions with `stream: true`."""

    response_id: str
    created: int
    model: str
    num_top: int
    progress: StreamProgress = field(default_factory=StreamProgress)

    def role_chunks(self, n: int) -> list[str]:
        """The first chunk of every choice: the assistant role and empty content."""
        return [self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant",
                                                                          content="")))
                for index in range(n)]

    def chunks(self, output: RequestOutput) -> list[str]:
        events = []
        for completion in output.outputs:
            delta = self.progress.advance(completion.index, completion)
            if delta is None:
                continue
            text, start, end = delta
            choice = ChatChunkChoice(
                index=completion.index,
                delta=ChatDelta(content=text) if text or not completion.finished else ChatDelta(),
                logprobs=chat_logprobs(completion, start, end, self.num_top),
                finish_reason=completion.finish_reason,
            )
            events.append(self._chunk(choice))
        return events

    def usage_chunk(self, output: RequestOutput) -> str:
        return sse(ChatCompletionChunk(id=self.response_id, created=self.created,
                                       model=self.model, choices=[], usage=usage([output])))

    def _chunk(self, choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=self.response_id, created=self.created,
                                       model=self.model, choices=[choice]))
