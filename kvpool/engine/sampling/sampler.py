"""Turns a step's logits into next tokens, one row per sequence, vectorised over the batch.

Order of operations on each row (float32):
1. log-probabilities of the raw logits, for the rows that asked for `logprobs` (nothing
   below changes them);
2. what a row may not generate, set to -inf: tokens outside its grammar (structured
   outputs: one int32 bitmask of the constrained rows, filled by their matchers and
   applied to all of them at once), tokens outside its `allowed_token_ids`, its bad words' last
   tokens where the output so far ends with the rest of the word, and its stop tokens while
   it is below `min_tokens`. Nothing later can lift a -inf (a bias or penalty keeps it -inf);
3. `logit_bias`, added (OpenAI's and vLLM's place for it: before penalties and temperature);
4. penalties: repetition (prompt and output tokens), presence and frequency (output tokens),
   counted for all penalised rows at once by one scatter-add;
5. greedy rows: the argmax of the finite logits. Random rows: temperature, top-k, top-p, min-p,
   then one draw by the inverse CDF: u ~ U[0, 1) per row, the token is the first whose
   cumulative probability exceeds u times the row's total. One uniform per row (not one
   random number per vocabulary entry, as an exponential race needs: 30x slower on the CPU
   for 32 rows of 49,152) lets each seeded row draw from its own generator while unseeded
   rows share one draw. A row whose probabilities come out NaN, infinite or all zero falls
   back to the argmax of its finite logits rather than to whatever index argmax gives NaN.
   A row with every token forbidden gets an arbitrary token; its grammar matcher then
   rejects it and the sequence ends;
6. each constrained row's grammar matcher advances by its chosen token, or for a drafted
   chunk's rows by the tokens the sequence keeps (the drafts the sampler agreed with and its
   token after them); last, once the logprobs are taken: nothing after it can fail.

Device: every tensor made here lives on the logits' device, and nothing in steps 2-5 reads a
value back to the host, so `choose_token_ids` runs on any device (the tests run it on "meta");
the host reads the chosen ids once, and the logprobs of the rows that asked once
(`logprob_entries`). The one
exception is the grammar bitmask, which xgrammar fills in host memory: it is copied to the
device once per step that has a constrained row. The generator that unseeded rows share is
made per device, seeded with the sampler's seed; a seeded row brings its own generator,
which must be on the logits' device.

Steps 2, 3 and 6 live in `kvpool.engine.sampling.constraints`, the row records in
`kvpool.engine.sampling.rows`. Work that no row needs (the
bitmask, sorting for top-k/top-p, penalty counts) is skipped entirely: a batch without
constrained rows never touches a matcher or a bitmask.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from kvpool.engine.requests.outputs import Logprob
from kvpool.engine.sampling.constraints import (
    advance_grammars,
    apply_allowed_token_ids,
    apply_grammar_bitmask,
    apply_logit_bias,
    apply_token_bans,
)
from kvpool.engine.sampling.logprob_entries import logprob_entries
from kvpool.engine.sampling.rows import SamplingRow


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row: sampled token + top alternatives


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.seed = 0 if seed is None else seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> SamplerOutput:
        token_ids = choose_token_ids(logits, rows, self.generator(logits.device)).tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
        wanted = {
            index: row.params.num_sampled_logprobs
            for index, row in enumerate(rows)
            if row.params.num_sampled_logprobs is not None
        }
        if wanted:
            entries = logprob_entries(raw_logprobs_of(logits, list(wanted)),
                                      [token_ids[index] for index in wanted], list(wanted.values()))
            for index, entry in zip(wanted, entries, strict=True):
                logprobs[index] = entry
        advance_grammars(rows, token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def generator(self, device: torch.device) -> torch.Generator:
        """The stream unseeded rows share on `device`; made on first use, seeded with `seed`."""
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def choose_token_ids(
    logits: torch.Tensor, rows: SequenceOf[SamplingRow], generator: torch.Generator | None
) -> torch.Tensor:
    """Steps 2-5 on the device: the next token of every row, [num_rows] int64.

    `generator` draws the unseeded rows' noise (None: the device's default generator).
    """
    # Masks, biases and penalties write in place: copy, so that the caller's logits stay raw.
    needs_writes = any(_writes_logits(row) for row in rows)
    logits = logits.to(torch.float32, copy=needs_writes)  # [num_rows, vocab]
    apply_grammar_bitmask(logits, rows)
    apply_allowed_token_ids(logits, rows)
    apply_token_bans(logits, rows)
    apply_logit_bias(logits, rows)
    apply_penalties(logits, rows)
    # Greedy rows' answer, and the fallback of random rows whose probabilities are unusable.
    token_ids = _finite_argmax(logits)
    random_rows = [index for index, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        subset = [rows[row_index] for row_index in random_rows]
        token_ids[index] = _sample(logits[index], subset, generator, fallback=token_ids[index])
    return token_ids


def _writes_logits(row: SamplingRow) -> bool:
    return bool(row.params.has_penalties or row.banned_token_ids or row.matcher is not None
                or not row.rules.is_empty)


def raw_logprobs_of(logits: torch.Tensor, row_indices: list[int]) -> torch.Tensor:
    """Log-probabilities of the raw logits of the given rows: [len(row_indices), vocab]."""
    index = torch.tensor(row_indices, device=logits.device)
    return torch.log_softmax(logits[index].float(), dim=-1)


def _finite_argmax(logits: torch.Tensor) -> torch.Tensor:
    # argmax takes NaN for the maximum; a NaN or infinite logit must never be chosen.
    minus_inf = float("-inf")
    return logits.nan_to_num(nan=minus_inf, posinf=minus_inf, neginf=minus_inf).argmax(dim=-1)


def _sample(
    logits: torch.Tensor,
    rows: SequenceOf[SamplingRow],
    generator: torch.Generator | None,
    fallback: torch.Tensor,
) -> torch.Tensor:
    device = logits.device
    temperatures = _column([row.params.temperature for row in rows], device)
    logits = apply_top_k_top_p(logits / temperatures, rows)
    probs = torch.softmax(logits, dim=-1)  # [num_random_rows, vocab]
    min_ps = [row.params.min_p for row in rows]
    if any(min_p > 0 for min_p in min_ps):
        min_p = _column(min_ps, device)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    cumulative = probs.cumsum(dim=-1)  # [num_random_rows, vocab]
    total = cumulative[:, -1:]
    targets = _uniforms(rows, generator, device) * total
    # right=True: the first token whose cumulative mass exceeds the target, so a token with no
    # mass (equal cumulative value to its predecessor) is never chosen, not even for u = 0.
    token_ids = torch.searchsorted(cumulative, targets, right=True).squeeze(1)
    # Usable rows have a finite, positive total; a target rounded up to the total (an event
    # of probability ~2^-24) would run past the vocabulary: the fallback takes it too.
    is_usable = torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
    is_usable &= token_ids < probs.shape[1]
    return torch.where(is_usable, token_ids, fallback)


def _uniforms(
    rows: SequenceOf[SamplingRow], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """U[0, 1) per row, [num_rows, 1]: one shared draw, then each seeded row redraws from its
    private stream (so its tokens do not depend on the rest of the batch)."""
    uniforms = torch.rand(len(rows), 1, generator=generator, device=device)
    for index, row in enumerate(rows):
        if row.generator is not None:
            assert _is_on(row.generator, device), (
                f"row generator on {row.generator.device}, logits on {device}: "
                "per-row generators must be created on the model's device"
            )
            uniforms[index] = torch.rand(1, generator=row.generator, device=device)
    return uniforms


def _is_on(generator: torch.Generator, device: torch.device) -> bool:
    # torch.Generator(device="cuda") carries no index: it serves the current CUDA device.
    return generator.device.type == device.type and generator.device.index in (None, device.index)


def apply_penalties(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties, in place, on the rows that have them.

    All penalised rows at once. A kind of penalty that no row has is skipped; a row without a
    kind that others have gets its identity (factor 1, subtrahend 0), which leaves its logits
    bit for bit as they were.
    """
    penalised = [index for index, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    subset = [rows[index] for index in penalised]
    repetition = [row.params.repetition_penalty for row in subset]
    frequency = [row.params.frequency_penalty for row in subset]
    presence = [row.params.presence_penalty for row in subset]
    index = torch.tensor(penalised, device=device)
    selected = logits[index]  # [num_penalised, vocab]
    counts = _count_tokens([row.output_token_ids for row in subset], vocab_size, device)
    occurred = counts > 0
    if any(penalty != 1.0 for penalty in repetition):
        prompts = [
            row.prompt_token_ids if penalty != 1.0 else ()
            for row, penalty in zip(subset, repetition, strict=True)
        ]
        seen = occurred | _has_tokens(prompts, vocab_size, device)
        factor = _column(repetition, device)
        repeated = torch.where(selected > 0, selected / factor, selected * factor)
        selected = torch.where(seen, repeated, selected)
    if any(penalty != 0.0 for penalty in frequency):
        selected -= _column(frequency, device) * counts
    if any(penalty != 0.0 for penalty in presence):
        selected -= _column(presence, device) * occurred
    logits[index] = selected
    return logits


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """One float32 value per row, shaped to broadcast over the vocabulary: [num_rows, 1]."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _count_tokens(
    token_lists: SequenceOf[SequenceOf[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each list holds each token, by one scatter-add: [num_lists, vocab] float32."""
    flat_ids = _flat_token_ids(token_lists, vocab_size, device)
    counts = torch.zeros(len(token_lists) * (vocab_size + 1), device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=counts.dtype))
    return counts.view(len(token_lists), vocab_size + 1)[:, :vocab_size]


def _has_tokens(
    token_lists: SequenceOf[SequenceOf[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Whether each list holds each token: [num_lists, vocab] bool."""
    flat_ids = _flat_token_ids(token_lists, vocab_size, device)
    mask = torch.zeros(len(token_lists) * (vocab_size + 1), dtype=torch.bool, device=device)
    mask.index_fill_(0, flat_ids, True)
    return mask.view(len(token_lists), vocab_size + 1)[:, :vocab_size]


def _flat_token_ids(
    token_lists: SequenceOf[SequenceOf[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Every list's ids as positions in a flat [num_lists, vocab_size + 1] table.

    Ids past the vocabulary land in the spare last column, which the callers cut off, so they
    count nowhere and cannot spill into the next list's row.
    """
    lengths = [len(token_ids) for token_ids in token_lists]
    token_ids = torch.tensor(
        list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64, device=device
    )
    row_starts = torch.arange(len(token_lists), device=device) * (vocab_size + 1)
    # output_size keeps repeat_interleave from reading the total back from the device.
    starts = row_starts.repeat_interleave(
        torch.tensor(lengths, device=device), output_size=sum(lengths)
    )
    return starts + token_ids.clamp(max=vocab_size)


# On the CPU, top-k/top-p look at the best `_CANDIDATES` tokens first (a partial sort, ~8x
# cheaper than sorting 49,152 logits); a row whose cut lies beyond them is sorted in full.
_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; one ranking serves both.

    top-p keeps the smallest set of best tokens whose probability (after top-k) reaches top_p.
    On the CPU the ranking is a top-k of the candidates, which decides a row exactly when its
    top_k lies within them or they already hold top_p of its mass; other rows (flat
    distributions) are ranked by a full sort. Elsewhere the full sort always runs: it is
    cheap on a GPU, and the candidate test would read a value back to the host.
    """
    vocab_size = logits.shape[1]
    top_k_list = [row.params.top_k or vocab_size for row in rows]
    top_p_list = [row.params.top_p for row in rows]
    if all(top_k >= vocab_size for top_k in top_k_list) and all(p >= 1.0 for p in top_p_list):
        return logits
    top_ks = torch.tensor(top_k_list, device=logits.device)
    top_ps = torch.tensor(top_p_list, dtype=torch.float32, device=logits.device)
    num_candidates = max(_CANDIDATES, *(k for k in top_k_list if k < vocab_size), 0)
    if logits.device.type != "cpu" or num_candidates >= vocab_size:
        return _mask_ranked(logits, *logits.sort(dim=-1, descending=True), top_ks, top_ps)
    candidate_logits, candidate_ids = logits.topk(num_candidates, dim=-1)  # sorted, best first
    masked = _mask_ranked(logits, candidate_logits, candidate_ids, top_ks, top_ps)
    needs_sort = _beyond_candidates(logits, candidate_logits, top_ks, top_ps)
    if needs_sort.any():
        index = needs_sort.nonzero()[:, 0]
        subset = logits[index]
        masked[index] = _mask_ranked(subset, *subset.sort(dim=-1, descending=True),
                                     top_ks[index], top_ps[index])
    return masked


def _mask_ranked(logits: torch.Tensor, ranked_logits: torch.Tensor, ranked_ids: torch.Tensor,
                 top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """`logits` with everything but each row's top-k/top-p set at -inf, given its best
    tokens in rank order (all of them, or candidates that decide the row); tokens not ranked
    are excluded."""
    ranks = torch.arange(ranked_logits.shape[1], device=logits.device)[None, :]
    excluded = ranks >= top_ks[:, None]
    ranked_logits = ranked_logits.masked_fill(excluded, float("-inf"))
    # Probabilities over the top-k set: the ranked tokens, or the whole row without a top-k.
    has_top_k = top_ks < logits.shape[1]
    log_total = torch.where(has_top_k, ranked_logits.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    ranked_probs = (ranked_logits - log_total[:, None]).exp()
    # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
    mass_before = ranked_probs.cumsum(dim=-1) - ranked_probs
    excluded |= mass_before >= top_ps[:, None]
    excluded[:, 0] = False
    mask = torch.ones_like(logits, dtype=torch.bool).scatter(1, ranked_ids, excluded)
    keeps_all = ~has_top_k & (top_ps >= 1.0)  # nothing to cut: unranked tokens stay too
    mask &= ~keeps_all[:, None]
    return logits.masked_fill(mask, float("-inf"))


def _beyond_candidates(logits: torch.Tensor, candidate_logits: torch.Tensor,
                       top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Rows the candidates do not decide: no top-k, a top-p below 1, and less than top_p of
    the row's mass among the candidates. [num_rows] bool"""
    candidate_mass = (candidate_logits - logits.logsumexp(dim=-1, keepdim=True)).exp().sum(-1)
    return (top_ks >= logits.shape[1]) & (top_ps < 1.0) & (candidate_mass < top_ps)
