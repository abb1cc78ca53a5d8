"""After sampling: append each new token, grow the text, decide whether the sequence stops,
and turn requests into `RequestOutput` records.

Stopping rules, checked in this order for each new token (stop tokens and stop strings only
once `min_tokens` outputs exist):
1. a stop token id, or EOS unless `ignore_eos`: "stop"; the token's text is not added;
2. a stop string anywhere in the text, also across token boundaries: "stop"; the text is cut
   just before it;
3. `max_tokens` outputs, or the sequence reaching `max_model_len`: "length".

While a request with stop strings runs, its visible text holds back the last
`len(longest stop string) - 1` characters, which might yet turn out to start a stop string,
so streamed text never has to be taken back.
"""

from __future__ import annotations

from kvpool.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpool.engine.sequence import FinishReason, Request, Sequence
from kvpool.model.detokenizer import IncrementalDetokenizer
from kvpool.model.tokenizer import Tokenizer

StopDecision = tuple[FinishReason, str | int | None]


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def start(self, seq: Sequence) -> None:
        """Prepare a new (or forked) sequence for text output."""
        params = seq.request.params
        if self.tokenizer is not None and seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens
            )
        if params.logprobs is not None and seq.logprobs is None:
            seq.logprobs = []

    def append_token(
        self, seq: Sequence, token_id: int, logprobs: dict[int, Logprob] | None
    ) -> StopDecision | None:
        """Record one sampled token; return why the sequence stops, or None."""
        params = seq.request.params
        seq.output_token_ids.append(token_id)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(self._decorate(logprobs))
        may_stop = len(seq.output_token_ids) >= params.min_tokens
        if may_stop and token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP, None
        delta = seq.detokenizer.add(token_id) if seq.detokenizer is not None else ""
        seq.text += delta
        if may_stop and params.stop and delta:
            stop_string = self._cut_at_stop_string(seq, len(delta))
            if stop_string is not None:
                return FinishReason.STOP, stop_string
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH, None
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def _cut_at_stop_string(self, seq: Sequence, delta_len: int) -> str | None:
        """Cut the text before the earliest stop string that the new text completes."""
        params = seq.request.params
        longest = max(len(stop) for stop in params.stop)
        search_from = max(0, len(seq.text) - delta_len - longest + 1)
        found: tuple[int, str] | None = None
        for stop in params.stop:
            position = seq.text.find(stop, search_from)
            if position != -1 and (found is None or position < found[0]):
                found = (position, stop)
        if found is None:
            return None
        seq.text = seq.text[: found[0]]
        return found[1]

    def flush(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None) -> None:
        """At a finish: emit characters held back for completion (not after a stop string)."""
        if seq.detokenizer is not None and not isinstance(stop_reason, str):
            seq.text += seq.detokenizer.flush()
        seq.stop_reason = stop_reason

    def _decorate(self, logprobs: dict[int, Logprob]) -> dict[int, Logprob]:
        if self.tokenizer is None:
            return logprobs
        return {
            token_id: Logprob(entry.logprob, entry.rank, self.tokenizer.decode([token_id]))
            for token_id, entry in logprobs.items()
        }

    # ----------------------------------------------------------------- outputs
    def make_output(self, request: Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[self._completion(seq) for seq in request.sequences],
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics=RequestMetrics(
                request.arrival_time, request.first_token_time, request.finish_time
            ),
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        params = seq.request.params
        text = seq.text
        if not seq.is_finished and params.stop:
            holdback = max(len(stop) for stop in params.stop) - 1
            text = text[: max(0, len(text) - holdback)]
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=None if seq.finish_reason is None else str(seq.finish_reason),
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            cumulative_logprob=_cumulative(seq),
        )


def _cumulative(seq: Sequence) -> float | None:
    if not seq.logprobs:
        return None
    return sum(
        entry[token].logprob
        for entry, token in zip(seq.logprobs, seq.output_token_ids, strict=False)
    )
