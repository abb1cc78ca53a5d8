"""SmolLM2 loaded by kvpool agrees with transformers: prefill logits, and greedy tokens when
prompts run together in mixed batches (prefill of some while others decode) through block tables.

Measured (fp32, CPU): prefill logits differ by at most ~4e-5 on logits of magnitude ~25;
the asserted bound is 1e-3 (4e-5 of the logit scale).
"""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.model_runner import ModelRunner, SequenceChunk
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.sequence_blocks import SequenceBlocks

LOGITS_ATOL = 1e-3
NUM_NEW_TOKENS = 32
BLOCK_SIZE = 16
PREFILL_CHUNK = 96  # long prompts prefill over several steps, next to other sequences' decodes

_STORY = (
    "The old lighthouse stood on a rocky cliff above the harbour. Every night the keeper climbed "
    "one hundred and twelve steps to light the lamp, and every morning he wrote the weather in "
    "a thick leather book. Ships passed safely for forty years. "
)
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one line."},
        {"role": "user", "content": "Name three primary colours."},
    ],
    [
        {"role": "user", "content": "Give me a word that rhymes with cat."},
        {"role": "assistant", "content": "Hat."},
        {"role": "user", "content": "And one that rhymes with dog?"},
    ],
    [{"role": "user", "content": _STORY * 5 + "Summarise the story above in one sentence."}],
]
RAW_PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):\n    ",
    _STORY * 6 + "The keeper's name was",
    "Les fleurs du jardin sont belles — 春天来了, and the café opened at 8 a.m. 🌸",
]


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tokenizer = smollm2.tokenizer
    chat = [tokenizer.apply_chat_template(messages) for messages in CHAT_PROMPTS]
    return chat + [tokenizer.encode(text) for text in RAW_PROMPTS]


def make_kv_cache(config, num_blocks: int) -> KVCache:
    """A cache of `num_blocks` blocks after the null block (ids 1 .. num_blocks)."""
    return KVCache(config.kv_layout(BLOCK_SIZE, torch.float32), num_blocks + 1)


def kvpool_prefill_logits(smollm2, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt's prefill. # [num_tokens, vocab]"""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    runner = ModelRunner(smollm2.model, make_kv_cache(smollm2.config, num_blocks))
    inputs = runner.prepare([SequenceChunk(token_ids, 0, list(range(1, num_blocks + 1)))])
    return smollm2.model(inputs.token_ids, inputs.positions, runner.kv_step(inputs),
                         torch.arange(len(token_ids)))


def test_prompts_are_varied(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8
    assert lengths[0] < 10 and lengths[-1] >= 250  # short and a few hundred tokens


@pytest.mark.parametrize("index", [0, 3, 5, 7])
def test_prefill_logits_match_transformers(smollm2, hf_smollm2, prompts, index):
    token_ids = prompts[index]
    ours = kvpool_prefill_logits(smollm2, token_ids)
    with torch.inference_mode():
        reference = hf_smollm2(torch.tensor([token_ids])).logits[0].float()
    assert ours.shape == reference.shape == (len(token_ids), smollm2.config.vocab_size)
    max_diff = (ours - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert max_diff < LOGITS_ATOL, f"max |logit diff| {max_diff:.2e} at logit scale {scale:.1f}"


def hf_greedy(hf_model, token_ids: list[int], num_new_tokens: int) -> list[int]:
    """transformers greedy decoding, one sequence, with its own KV cache; never stops at EOS."""
    generated: list[int] = []
    past = None
    step_input = torch.tensor([token_ids])
    with torch.inference_mode():
        for _ in range(num_new_tokens):
            out = hf_model(step_input, cache=past, use_cache=True)
            past = out.past_key_values
            generated.append(int(out.logits[0, -1].argmax()))
            step_input = torch.tensor([[generated[-1]]])
    return generated


class _Sequence:
    """One prompt in the mixed-batch test: its block table and what it has produced."""

    def __init__(self, pool: BlockPool, prompt: list[int]) -> None:
        self.table = SequenceBlocks(pool)
        self.prompt = prompt
        self.num_computed_tokens = 0
        self.output: list[int] = []

    def next_chunk(self) -> SequenceChunk:
        if self.num_computed_tokens < len(self.prompt):  # prefill, in chunks
            new = self.prompt[self.num_computed_tokens : self.num_computed_tokens + PREFILL_CHUNK]
            needs_logits = self.num_computed_tokens + len(new) == len(self.prompt)
        else:  # decode the last sampled token
            new, needs_logits = self.output[-1:], True
        self.table.append_tokens(new)
        block_ids = list(self.table.block_ids)
        chunk = SequenceChunk(new, self.num_computed_tokens, block_ids, int(needs_logits))
        self.num_computed_tokens += len(new)
        return chunk


def kvpool_greedy_mixed_batches(smollm2, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy decoding with sequences arriving in waves: every step mixes decodes of earlier
    arrivals with (chunked) prefills of later ones."""
    num_blocks = sum(-(-(len(p) + NUM_NEW_TOKENS) // BLOCK_SIZE) for p in prompts)
    pool = BlockPool(num_blocks, KVLayout(BLOCK_SIZE), enable_prefix_caching=False)
    runner = ModelRunner(smollm2.model, make_kv_cache(smollm2.config, num_blocks))
    arrivals = {0: [0, 4, 2], 2: [3, 1], 3: [5, 7], 5: [6]}  # step -> prompt indices
    sequences = {i: _Sequence(pool, prompts[i]) for i in range(len(prompts))}
    active: list[int] = []
    num_mixed_steps = 0
    for step in range(1000):
        active += arrivals.get(step, [])
        active = [i for i in active if len(sequences[i].output) < NUM_NEW_TOKENS]
        if not active and step > max(arrivals):
            break
        chunks = [sequences[i].next_chunk() for i in active]
        num_mixed_steps += len({len(c.token_ids) == 1 for c in chunks}) == 2
        logits = runner.execute(chunks).sampling
        sampled = iter(logits.argmax(dim=-1).tolist())
        for i, chunk in zip(active, chunks, strict=True):
            if chunk.num_samples:
                sequences[i].output.append(next(sampled))
    assert num_mixed_steps >= 3, "the schedule should mix prefill and decode in several steps"
    for sequence in sequences.values():
        sequence.table.free()
    return [sequences[i].output for i in range(len(prompts))]


def test_greedy_mixed_batches_match_transformers(smollm2, hf_smollm2, prompts):
    ours = kvpool_greedy_mixed_batches(smollm2, prompts)
    reference = [hf_greedy(hf_smollm2, p, NUM_NEW_TOKENS) for p in prompts]
    for index, (got, expected) in enumerate(zip(ours, reference, strict=True)):
        diverged_at = _first_difference(got, expected)
        assert got == expected, f"prompt {index} diverged at new token {diverged_at}"


def _first_difference(a: list[int], b: list[int]) -> int:
    differences = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differences, min(len(a), len(b)))
