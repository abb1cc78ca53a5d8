"""Prompt logprobs (`SamplingParams.prompt_logprobs=k`, vLLM's meaning): which prompt positions
need logits, and the log probabilities those logits give.

A prompt of P tokens gets P entries: entry 0 is None (the first token has no context), entry i
holds the log probability of prompt token i given tokens < i, with its rank, plus the k most
likely tokens at that position, all from the raw logits (log_softmax in float32). Entry i comes
from the logits at position i - 1, so positions 0 .. P - 2 need logits rows; position P - 1's
row samples the first output, as for any request.

A request counts the positions already done (`Request.num_prompt_logprob_positions`), and a
chunk computing positions [start, end) asks for the pending ones among them (`chunk_positions`).
So chunked prefill accumulates the entries in order, with nothing special at a chunk boundary:
the first token of a later chunk gets its entry from the previous chunk's last position, whose
row that chunk returned (the target token is the prompt's, already known). A recompute after
preemption asks for no position twice. A cached position is never computed, so it gives no
logits: a prefix lookup serves a request at most its tokens before the first pending position
(`kv_manager._num_query_tokens`). A new request takes no cached prefix (as in vLLM); one
preempted after some positions were done may take back a prefix up to there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvpool.engine.requests.outputs import Logprob
from kvpool.engine.sampling.logprob_entries import logprob_entries
from kvpool.engine.scheduler_output import ScheduledChunk
from kvpool.engine.sequence import Request


@dataclass(frozen=True, slots=True)
class PromptLogprobsChunk:
    """Entries `first_entry ..` of a request's prompt logprobs, from one step."""

    request: Request
    first_entry: int
    entries: list[dict[int, Logprob]]


def pending_positions(request: Request) -> range:
    """The prompt positions whose logits the request still needs (empty if it asked none)."""
    if request.params.prompt_logprobs is None:
        return range(0)
    return range(request.num_prompt_logprob_positions, len(request.prompt_token_ids) - 1)


def chunk_positions(request: Request, start: int, end: int) -> range:
    """The pending positions among a chunk's positions [start, end)."""
    pending = pending_positions(request)
    first = max(start, pending.start)
    return range(first, max(first, min(end, pending.stop)))


def prompt_logprobs_of(
    chunks: Iterable[ScheduledChunk], logits: torch.Tensor  # [num_prompt_rows, vocab]
) -> list[PromptLogprobsChunk]:
    """The entries a step's prompt-logprob rows give: `logits` holds every chunk's rows of its
    `prompt_logprob_positions`, chunk after chunk."""
    results: list[PromptLogprobsChunk] = []
    row = 0
    for chunk in chunks:
        positions = chunk.prompt_logprob_positions
        if not positions:
            continue
        request = chunk.seq.request
        targets = request.prompt_token_ids[positions.start + 1 : positions.stop + 1]
        rows = logits[row : row + len(positions)]
        entries = gather_prompt_logprobs(rows, targets, request.params.prompt_logprobs or 0)
        results.append(PromptLogprobsChunk(request, positions.start + 1, entries))
        row += len(positions)
    assert row == logits.shape[0], "prompt-logprob rows do not match the chunks"
    return results


def gather_prompt_logprobs(
    logits: torch.Tensor, target_ids: list[int], num_top: int  # logits: [num_rows, vocab]
) -> list[dict[int, Logprob]]:
    """Per row: the target token's log probability and rank (1 + the tokens more likely), then
    the `num_top` most likely tokens, from the raw logits (the sampler's entries)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprob_entries(logprobs, target_ids, [num_top] * len(target_ids))
