"""What the sampler is told about each logits row of a step: `sampling_rows(batch, eos)`."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.engine.sampler import SamplingRow
from kvpool.engine.scheduler_output import SchedulerOutput


def sampling_rows(batch: SchedulerOutput, eos_token_ids: Sequence[int]) -> list[SamplingRow]:
    """One row per logits row: each sampled sequence, or a sibling about to be forked. Below
    `min_tokens` a row bans EOS (unless `ignore_eos`) and the request's stop token ids."""
    rows = []
    for seq, index in batch.sampled_sequences():
        params = seq.request.params
        banned: tuple[int, ...] = ()
        if len(seq.output_token_ids) < params.min_tokens:
            eos = () if params.ignore_eos else tuple(eos_token_ids)
            banned = eos + tuple(params.stop_token_ids)
        request = seq.request
        rows.append(SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids,
                                request.generators[index], banned,
                                request.matchers[index] if request.matchers else None,
                                request.bad_words_token_ids))
    return rows
