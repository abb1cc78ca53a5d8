"""What the sampler is told about each logits row of a step (`SamplingRow`), and how a
scheduled batch becomes those rows (`sampling_rows`).

The bottom of `kvpool.engine.sampling` but for `matcher` and `token_rules` (which import
nothing here): `constraints` and `sampler` import this module, and it imports neither
(token_rules → rows → constraints → sampler, one way). What a row's grammar matcher must do
is `matcher.TokenMask`.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpool.engine.sampling.matcher import TokenMask
from kvpool.engine.sampling.token_rules import NO_TOKEN_RULES, TokenRules
from kvpool.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpool.engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_token_ids: SequenceOf[int]
    output_token_ids: SequenceOf[int]
    generator: torch.Generator | None  # on the logits' device, for a seeded row
    banned_token_ids: tuple[int, ...] = ()  # stop tokens while below min_tokens
    matcher: TokenMask | None = None  # the sequence's grammar (structured outputs)
    rules: TokenRules = NO_TOKEN_RULES  # the request's logit bias, allowed ids, bad words
    # A verification row: the drafts before it. `output_token_ids` end with them only where
    # penalties or bad words read them; the grammar walks its matcher through them.
    draft_token_ids: tuple[int, ...] = ()


def sampling_rows(batch: SchedulerOutput, eos_token_ids: SequenceOf[int]) -> list[SamplingRow]:
    """One row per logits row: each sampled sequence, or a sibling about to be forked, or a
    drafted position (its outputs then end with the drafts before it). Below `min_tokens` a
    row bans EOS (unless `ignore_eos`) and the request's stop token ids."""
    rows = []
    for seq, index, drafts in batch.sampled_sequences():
        request = seq.request
        params = request.params
        outputs = seq.output_token_ids
        if drafts and (params.has_penalties or request.token_rules.bad_word_prefixes):
            outputs = outputs + list(drafts)  # only these rows read what precedes them
        banned: tuple[int, ...] = ()
        if len(seq.output_token_ids) + len(drafts) < params.min_tokens:
            eos = () if params.ignore_eos else tuple(eos_token_ids)
            banned = eos + tuple(params.stop_token_ids)
        rows.append(SamplingRow(params, seq.prompt_token_ids, outputs,
                                request.generator(index), banned,
                                request.matchers[index] if request.matchers else None,
                                request.token_rules, tuple(drafts)))
    return rows
