"""What callers see of their sequences: text, logprobs, stop decisions, and `RequestOutput`s.

The output processor owns each sequence's caller-facing state (`_OutputState`: its incremental
detokenizer, text, logprobs, and how much of them has been handed out); the scheduler owns
its tokens and KV. It is the scheduler's `StopChecker`: `on_token` records each sampled token
and says whether the sequence stops. Rules, in this order (stop tokens and stop strings only
once `min_tokens` outputs exist):
1. a stop token id, or EOS unless `ignore_eos`: "stop"; the token's text is not added;
2. a stop string that the new text completes (an occurrence ending in the text this token
   added, looked for per stop string): "stop"; the text is cut just before it, or just after
   it with `include_stop_str_in_output` (then at the stop string that ends first);
3. `max_tokens` outputs, or the sequence reaching `max_model_len`: "length".

While a request with stop strings runs, its visible text holds back the last
`len(longest stop string) - 1` characters, which might yet turn out to start a stop string,
so text once handed out never has to be taken back. With `include_stop_str_in_output` nothing
is held back (as in vLLM): the cut falls after a stop string that ends in the newest text, so
past everything handed out before.

Prompt logprobs (`add_prompt_logprobs`, from each step's prompt-logprob rows) accumulate per
request; they are handed out once complete, in every output, or only the first with DELTA.

Outputs follow the request's `SamplingParams.output_kind` (vLLM's `RequestOutputKind`):
CUMULATIVE hands out everything so far each time; DELTA only what is new since the previous
output (text, token ids, logprobs; `cumulative_logprob` stays a running total); FINAL_ONLY one
output, when the request finishes. Nothing is copied that is not handed out, so a long DELTA or
FINAL_ONLY generation costs O(tokens), not O(tokens²). A finished request's state is dropped
once its final output is made.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvpool.engine.beams.group import FinishedBeam
from kvpool.engine.requests.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpool.engine.requests.prompt_logprobs import prompt_logprobs_of
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpool.engine.scheduler import StopDecision
from kvpool.engine.scheduler_output import ScheduledChunk
from kvpool.engine.sequence import FinishReason, Request, Sequence
from kvpool.model.detokenizer import IncrementalDetokenizer
from kvpool.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _OutputState:
    """One sequence as its caller sees it, and how far it has been handed out."""

    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None  # None: the request asked for none
    text: str = ""
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    is_flushed: bool = False


@dataclass(slots=True)
class _PromptLogprobs:
    """A request's prompt logprobs so far (entry 0, the first token's, is None)."""

    entries: list[dict[int, Logprob] | None] = field(default_factory=lambda: [None])
    is_sent: bool = False  # DELTA: the first output carried them


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._states: dict[Sequence, _OutputState] = {}
        self._prompt_logprobs: dict[Request, _PromptLogprobs] = {}

    def _state(self, seq: Sequence) -> _OutputState:
        state = self._states.get(seq)
        if state is None:
            params = seq.request.params
            detokenizer = None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
            state = _OutputState(detokenizer, [] if params.logprobs is not None else None)
            self._states[seq] = state
        return state

    # ------------------------------------------------------------ stop rules
    def on_token(
        self, seq: Sequence, token_id: int, logprobs: dict[int, Logprob] | None
    ) -> StopDecision | None:
        """Record the token `seq` just got (already appended to it); return why the sequence
        stops, or None. A structured sequence's grammar, already advanced by the sampler, is
        read at this token (after a verification it has accepted all the kept tokens before
        they join one by one): a token it rejected (only possible when it masked every token)
        stops the sequence, and so does a grammar that ended with this token or before (its
        stop token accepted where EOS does not stop, e.g. ignore_eos)."""
        params = seq.request.params
        state = self._state(seq)
        if state.logprobs is not None and logprobs is not None:
            state.logprobs.append(self._decorate(logprobs))
            state.cumulative_logprob += logprobs[token_id].logprob
        num_outputs = len(seq.output_token_ids)
        if seq.matcher is not None and seq.matcher.has_rejected(num_outputs):
            logger.warning("request %s: its grammar rejected token %d (every token was masked)"
                           "; stopping", seq.request.request_id, token_id)
            return FinishReason.STOP, None
        may_stop = num_outputs >= params.min_tokens
        if may_stop and token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP, None
        if seq.matcher is not None and seq.matcher.has_ended(num_outputs):
            return FinishReason.STOP, None
        delta = state.detokenizer.add(token_id) if state.detokenizer is not None else ""
        state.text += delta
        if may_stop and params.stop and delta:
            stop_string = _cut_at_stop_string(state, len(delta), params.stop,
                                              params.include_stop_str_in_output)
            if stop_string is not None:
                return FinishReason.STOP, stop_string
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH, None
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def _decorate(self, logprobs: dict[int, Logprob]) -> dict[int, Logprob]:
        if self.tokenizer is None:
            return logprobs
        return {
            token_id: Logprob(entry.logprob, entry.rank, self.tokenizer.decode([token_id]))
            for token_id, entry in logprobs.items()
        }

    # ------------------------------------------------------------ prompt logprobs
    def add_prompt_logprobs(
        self, chunks: Iterable[ScheduledChunk], logits: torch.Tensor  # [num_prompt_rows, vocab]
    ) -> None:
        """Record the entries a step's prompt-logprob rows give (every chunk's rows of its
        `prompt_logprob_positions`, chunk after chunk). All are computed before any is kept,
        so a step that fails here leaves nothing half-recorded."""
        decorated = [(result.request, result.first_entry,
                      [self._decorate(entry) for entry in result.entries])
                     for result in prompt_logprobs_of(chunks, logits)]
        for request, first_entry, entries in decorated:
            record = self._prompt_logprobs.setdefault(request, _PromptLogprobs())
            assert len(record.entries) == first_entry, "prompt logprobs out of order"
            record.entries.extend(entries)

    def _prompt_logprobs_out(
        self, request: Request, kind: RequestOutputKind
    ) -> list[dict[int, Logprob] | None] | None:
        """The request's prompt logprobs, once complete (None before, or when not asked)."""
        if request.params.prompt_logprobs is None:
            return None
        record = self._prompt_logprobs.setdefault(request, _PromptLogprobs())
        if record.is_sent or len(record.entries) < len(request.prompt_token_ids):
            return None
        entries = record.entries
        if kind is RequestOutputKind.DELTA:
            record.is_sent, record.entries = True, []
        return entries

    # ----------------------------------------------------------------- outputs
    def make_output(self, request: Request) -> RequestOutput | None:
        """The request's output now, as its output kind asks (None: nothing to hand out yet,
        for FINAL_ONLY before the end)."""
        kind = request.params.output_kind
        is_finished = request.is_finished
        if kind is RequestOutputKind.FINAL_ONLY and not is_finished:
            return None
        if request.beams is not None:
            completions = self._beam_completions(request) if is_finished else []
        else:
            completions = [self._completion(seq, kind) for seq in request.sequences]
        prompt_logprobs = self._prompt_logprobs_out(request, kind)
        if is_finished:
            for seq in request.sequences:
                self._states.pop(seq, None)
            self._prompt_logprobs.pop(request, None)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=is_finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics=_take_metrics(request),
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=request.kv_transfer_params,
            error=request.error,
        )

    def _beam_completions(self, request: Request) -> list[CompletionOutput]:
        """A finished beam search's n best beams, best first (an aborted one's live beams
        count as they stood: `Scheduler.finish` recorded them)."""
        return [self._beam_completion(index, done, request.params)
                for index, done in enumerate(request.beams.best(request.params.n))]

    def _beam_completion(self, index: int, done: FinishedBeam,
                         params: SamplingParams) -> CompletionOutput:
        token_ids = list(done.token_ids)
        text_ids = token_ids[:len(token_ids) - done.ends_in_eos]
        text = "" if self.tokenizer is None else self.tokenizer.decode(
            text_ids, skip_special_tokens=params.skip_special_tokens)
        return CompletionOutput(
            index=index, text=text, token_ids=token_ids, finish_reason=done.finish_reason,
            stop_reason=token_ids[-1] if done.ends_in_eos else None,
            logprobs=None if params.logprobs is None else [
                self._decorate(row) for row in done.beam.logprobs],
            cumulative_logprob=done.beam.cum_logprob,
        )

    def _completion(self, seq: Sequence, kind: RequestOutputKind) -> CompletionOutput:
        state = self._state(seq)
        params = seq.request.params
        if seq.is_finished and not state.is_flushed:
            state.is_flushed = True  # held-back characters go out (not after a stop string)
            if state.detokenizer is not None and not isinstance(seq.stop_reason, str):
                state.text += state.detokenizer.flush()
        visible = len(state.text)
        if not seq.is_finished and params.stop:
            visible = max(state.num_sent_chars, visible - _holdback(params))
        start_token = state.num_sent_tokens if kind is RequestOutputKind.DELTA else 0
        start_char = state.num_sent_chars if kind is RequestOutputKind.DELTA else 0
        num_tokens = len(seq.output_token_ids)
        state.num_sent_tokens, state.num_sent_chars = num_tokens, visible
        logprobs = state.logprobs
        return CompletionOutput(
            index=seq.index,
            text=state.text[start_char:visible],
            token_ids=seq.output_token_ids[start_token:num_tokens],
            finish_reason=None if seq.finish_reason is None else str(seq.finish_reason),
            stop_reason=seq.stop_reason,
            logprobs=None if logprobs is None else logprobs[start_token:num_tokens],
            cumulative_logprob=state.cumulative_logprob if logprobs else None,
        )


def _take_metrics(request: Request) -> RequestMetrics:
    """The request's times, handing out (and clearing) the inter-token gaps recorded since
    its previous output, so that each gap is handed out once."""
    gaps, request.inter_token_latencies = tuple(request.inter_token_latencies), []
    return RequestMetrics(
        request.arrival_time, request.first_token_time, request.finish_time,
        first_scheduled_time=request.first_scheduled_time,
        last_token_time=request.last_token_time, inter_token_latencies=gaps,
    )


def _holdback(params: SamplingParams) -> int:
    if params.include_stop_str_in_output:
        return 0
    return max(len(stop) for stop in params.stop) - 1


def _cut_at_stop_string(
    state: _OutputState, delta_len: int, stops: list[str], include: bool
) -> str | None:
    """Cut the text at a stop string that the newest `delta_len` characters complete: before
    the earliest-starting one, or (`include`) after the earliest-ending one, so the text ends
    where generation should have stopped. Each stop string is looked for only where it would
    end in the newest characters."""
    text = state.text
    found: tuple[int, int, str] | None = None  # (cut, start, stop string)
    for stop in stops:
        position = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
        if position == -1:
            continue
        cut = position + len(stop) if include else position
        if found is None or (cut, position) < found[:2]:
            found = (cut, position, stop)
    if found is None:
        return None
    state.text = text[: found[0]]
    return found[2]
