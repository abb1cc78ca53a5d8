"""Turns a step's logits into next tokens, one row per sequence, vectorised over the batch.

Order of operations on each row (float32):
1. log-probabilities of the raw logits, when any row asked for `logprobs`;
2. penalties: repetition (prompt and output tokens), presence and frequency (output tokens);
3. stop tokens banned while a row is below its `min_tokens`;
4. greedy rows: argmax. Random rows: temperature, top-k, top-p, min-p, then one draw by the
   exponential race (argmax of p / q with q ~ Exp(1)), which equals sampling from p and lets
   each seeded row draw q from its own generator while unseeded rows share one draw.

Work that no row needs (sorting for top-k/top-p, penalty counts) is skipped entirely.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from kvpool.engine.outputs import Logprob
from kvpool.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_token_ids: SequenceOf[int]
    output_token_ids: SequenceOf[int]
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()  # stop tokens while below min_tokens


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row: sampled token + top alternatives


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(0 if seed is None else seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> SamplerOutput:
        logits = logits.float()  # [num_rows, vocab]
        raw_logprobs = None
        if any(row.params.logprobs is not None for row in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_penalties(logits.clone(), rows)
        for index, row in enumerate(rows):
            if row.banned_token_ids:
                logits[index, list(row.banned_token_ids)] = float("-inf")
        token_ids = self._choose(logits, rows)
        logprobs = [
            None
            if raw_logprobs is None or row.params.logprobs is None
            else gather_logprobs(raw_logprobs[index], token_ids[index], row.params.logprobs)
            for index, row in enumerate(rows)
        ]
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _choose(self, logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> list[int]:
        chosen = logits.argmax(dim=-1)
        random_rows = [index for index, row in enumerate(rows) if not row.params.is_greedy]
        if random_rows:
            subset = [rows[index] for index in random_rows]
            chosen[random_rows] = self._sample(logits[random_rows], subset)
        return chosen.tolist()

    def _sample(self, logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> torch.Tensor:
        temperatures = torch.tensor([row.params.temperature for row in rows])
        logits = logits / temperatures[:, None]
        logits = apply_top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        min_ps = torch.tensor([row.params.min_p for row in rows])
        if bool((min_ps > 0).any()):
            threshold = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        for index, row in enumerate(rows):
            if row.generator is not None:
                race[index].exponential_(generator=row.generator)
        return (probs / race).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties, in place, on the rows that have them."""
    vocab_size = logits.shape[1]
    for index, row in enumerate(rows):
        params = row.params
        if not params.has_penalties:
            continue
        output_counts = torch.bincount(
            torch.tensor(row.output_token_ids, dtype=torch.int64), minlength=vocab_size
        )[:vocab_size].float()
        if params.repetition_penalty != 1.0:
            seen = output_counts > 0
            seen[torch.tensor(row.prompt_token_ids, dtype=torch.int64)] = True
            penalised = torch.where(
                logits[index] > 0,
                logits[index] / params.repetition_penalty,
                logits[index] * params.repetition_penalty,
            )
            logits[index] = torch.where(seen, penalised, logits[index])
        logits[index] -= params.frequency_penalty * output_counts
        logits[index] -= params.presence_penalty * (output_counts > 0).float()
    return logits


def apply_top_k_top_p(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; one sort serves both."""
    vocab_size = logits.shape[1]
    top_ks = torch.tensor([row.params.top_k or vocab_size for row in rows])
    top_ps = torch.tensor([row.params.top_p for row in rows])
    if bool((top_ks >= vocab_size).all()) and bool((top_ps >= 1.0).all()):
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size)[None, :]
    excluded = ranks >= top_ks[:, None]
    sorted_logits = sorted_logits.masked_fill(excluded, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    excluded |= mass_before >= top_ps[:, None]
    excluded[:, 0] = False
    mask = torch.zeros_like(excluded).scatter(1, sorted_ids, excluded)
    return logits.masked_fill(mask, float("-inf"))


def gather_logprobs(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> dict[int, Logprob]:
    """The sampled token's log probability and rank, plus the `num_top` most likely tokens."""
    sampled = float(row_logprobs[token_id])
    result = {token_id: Logprob(sampled, rank=int((row_logprobs > sampled).sum()) + 1)}
    if num_top:
        values, ids = row_logprobs.topk(num_top)
        for rank, (value, top_id) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            result.setdefault(top_id, Logprob(value, rank=rank + 1))
    return result
