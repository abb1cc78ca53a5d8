"""What the engine hands back: vLLM-shaped `RequestOutput` and `CompletionOutput` records."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Logprob:
    """A token's log probability under the model's raw distribution, and its rank there."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a request's n completions, as far as it has got.

    With `RequestOutputKind.DELTA`, `text`, `token_ids` and `logprobs` hold only what is new
    since the request's previous output (`cumulative_logprob` is still the running total);
    otherwise they hold everything so far.

    `finish_reason` is "stop" (EOS, a stop token or a stop string; none of them appears in
    `text`), "length" (max_tokens, max_model_len or the whole KV pool) or "abort"; None while
    running. `stop_reason` is the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's life."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One `DELTA` output carrying what two consecutive ones do (for a consumer that fell
    behind): text, token ids and logprobs concatenated per completion, the rest the later's."""
    earlier_by_index = {completion.index: completion for completion in earlier.outputs}
    merged = []
    for completion in later.outputs:
        before = earlier_by_index.get(completion.index)
        if before is not None:
            logprobs = completion.logprobs
            if before.logprobs is not None and logprobs is not None:
                logprobs = before.logprobs + logprobs
            completion = dataclasses.replace(
                completion,
                text=before.text + completion.text,
                token_ids=before.token_ids + completion.token_ids,
                logprobs=logprobs,
            )
        merged.append(completion)
    return dataclasses.replace(later, outputs=merged)
