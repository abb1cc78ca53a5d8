"""Sampled output follows the target distribution exactly with speculation on: a statistical
test on a model small enough to know its distribution in closed form.

The model is a bigram chain over 6 tokens (its logits depend only on the current token), so
the probability of any output is a product of table entries. Prompt lookup drafts from the
prompt and the outputs so far; verification keeps a draft only when the token drawn from the
target distribution equals it. Unseeded requests (one shared stream), many of them, batched:
the empirical distribution of the first three output tokens is compared with the exact one by
a chi-square test at a tiny false-alarm rate.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts
from kvpool.model import presets
from kvpool.model.loaders.base import LoadedModel

VOCAB = 6


class BigramModel(torch.nn.Module):
    """Logits of the next token from the current one only (a `CausalLM`; it keeps no KV)."""

    dtype = torch.float32

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.table = logits

    def forward(self, token_ids, positions, kv, logits_indices):
        return self.table[token_ids[logits_indices]]


def chi_square_threshold(df: int, z: float = 5.0) -> float:
    """The chi-square quantile z standard deviations out (Wilson-Hilferty); z = 5: a false
    alarm about once in 3.5 million runs."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_follow_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    # Peaked rows (drafts often right) and flat ones (often wrong): both paths are exercised.
    table = torch.randn(VOCAB, VOCAB, generator=generator) * 2.5
    config = dataclasses.replace(presets.preset("tiny"), vocab_size=VOCAB,
                                 eos_token_ids=frozenset(), bos_token_id=None)
    model = LoadedModel(config, BigramModel(table), None, 0.0)
    engine_config = EngineConfig(
        dtype="float32", enable_warmup=False, max_num_seqs=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    engine = LLMEngine(engine_config, build_engine_parts(engine_config, model))
    prompt = [0, 1, 2, 0, 1, 3, 0, 1, 2, 4, 5, 0, 1]  # rich in lookups; ends at token 1
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    num_samples = 6000
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(num_samples // 64):
        ids = [engine.add_request({"prompt_token_ids": prompt}, params).request_id
               for _ in range(64)]
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = tuple(output.outputs[0].token_ids)
        for request_id in ids:
            counts[done[request_id]] = counts.get(done[request_id], 0) + 1
    stats = engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    probs = torch.softmax(table.double(), dim=-1)
    total = sum(counts.values())
    chi_square, cells = 0.0, 0
    for triple in itertools.product(range(VOCAB), repeat=3):
        p = probs[prompt[-1], triple[0]] * probs[triple[0], triple[1]] * probs[triple[1], triple[2]]
        expected = float(p) * total
        if expected >= 5:  # the test's usual rule; rarer outcomes are pooled below
            chi_square += (counts.get(triple, 0) - expected) ** 2 / expected
            cells += 1
    rare_expected = total - sum(
        float(probs[prompt[-1], a] * probs[a, b] * probs[b, c]) * total
        for a, b, c in itertools.product(range(VOCAB), repeat=3)
        if float(probs[prompt[-1], a] * probs[a, b] * probs[b, c]) * total >= 5)
    rare_seen = total - sum(counts.get(t, 0) for t in itertools.product(range(VOCAB), repeat=3)
                            if float(probs[prompt[-1], t[0]] * probs[t[0], t[1]]
                                     * probs[t[1], t[2]]) * total >= 5)
    if rare_expected >= 5:
        chi_square += (rare_seen - rare_expected) ** 2 / rare_expected
        cells += 1
    assert chi_square < chi_square_threshold(cells - 1), (chi_square, cells)
