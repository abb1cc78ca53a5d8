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
    `text`, but a stop string with `include_stop_str_in_output`), "length" (max_tokens,
    max_model_len or the whole KV pool) or "abort"; None while running. `stop_reason` is the
    stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """Whether this completion is done (a method, as in vLLM; `RequestOutput.finished`,
        the whole request's, is a field)."""
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
    # With `prompt_logprobs=k`: one entry per prompt token, the first None (see
    # `kvpool.engine.requests.prompt_logprobs`); in the first output (DELTA) or every output.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's: a prefill worker's handover for the decode worker (`kvpool.engine.kv_connector`).
    kv_transfer_params: dict | None = None
    error: str | None = None  # set when the request failed (a KV load, policy "fail")


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Times (time.monotonic seconds) of a request's life, as vLLM's request stats keep them.

    `first_scheduled_time`: its first admission to a batch (vLLM's first SCHEDULED event;
    re-admissions after preemption do not move it). `first_token_time` / `last_token_time`:
    the engine steps that gave it its first and newest tokens (vLLM's first and last NEW_TOKENS
    timestamps). `inter_token_latencies`: the gaps between successive steps that gave it
    tokens, preemptions included, for the steps since its previous output only (all of them
    in a FINAL_ONLY output), so that a consumer counting every output counts each gap once.
    """

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: tuple[float, ...] = ()


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One `DELTA` output carrying what two consecutive ones do (for a consumer that fell
    behind): text, token ids and logprobs concatenated per completion, the prompt logprobs
    of whichever carries them, the rest the later's."""
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
    prompt_logprobs = later.prompt_logprobs or earlier.prompt_logprobs  # only one carries them
    return dataclasses.replace(later, outputs=merged, prompt_logprobs=prompt_logprobs,
                               metrics=_merge_metrics(earlier.metrics, later.metrics))


def _merge_metrics(
    earlier: RequestMetrics | None, later: RequestMetrics | None
) -> RequestMetrics | None:
    """The later's times, with both outputs' inter-token gaps (each is counted once)."""
    if earlier is None or later is None:
        return later
    gaps = earlier.inter_token_latencies + later.inter_token_latencies
    return dataclasses.replace(later, inter_token_latencies=gaps)
