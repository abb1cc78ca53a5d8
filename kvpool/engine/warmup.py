"""Start-up warm-up: one dummy batch, so the first real request pays no first-use costs.

What a first batch pays and later ones do not: operators dispatched and kernels loaded for the
first time (on CUDA: Triton kernels compiled, cuBLAS handles and workspaces made), torch's
allocator growing its pools, the tokenizer's first decode, the sampler's sort and log-softmax
paths. The warm-up pays them at start-up instead.

The dummy batch: two sequences whose prompts (of different lengths, so padding is exercised)
and outputs stay inside one block, so no full block is published to the prefix cache. One is
greedy with logprobs, the other samples with top-k/top-p from its own seed, so the sampler's
shared random stream is left untouched. The first step prefills both, the second decodes both.
Afterwards `engine.reset_stats()` puts the KV pool back to its start-up state (no cached block,
free blocks in their first order, elastic segments grown for the batch given back) and zeroes
every engine, scheduler and pool counter: the engine reads as if nothing ran.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvpool.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpool.engine.engine import LLMEngine

MAX_PROMPT_TOKENS = 8
NUM_OUTPUT_TOKENS = 2  # the first comes from the prefill step, the second from a decode step


def warm_up(engine: LLMEngine) -> float:
    """Run the dummy batch on `engine`, then reset its statistics; returns the seconds taken."""
    start = time.perf_counter()
    # Prompt + first output token must leave the block unfilled (block_size - 2 at most).
    block_size = engine.kv_memory.layout.block_size
    prompt_len = min(MAX_PROMPT_TOKENS, block_size - 2, engine.max_model_len - 2)
    prompt_len = max(1, prompt_len)
    if prompt_len >= engine.max_model_len:
        return 0.0  # a model too short to run even the dummy batch
    greedy = SamplingParams(temperature=0, max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True,
                            logprobs=1)
    sampled = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=0,
                             max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True)
    vocab_size = engine.model_config.vocab_size
    for index, params in enumerate((greedy, sampled)):
        num_tokens = max(1, prompt_len - index)
        token_ids = [(1 + token) % vocab_size for token in range(num_tokens)]
        engine.add_request(token_ids, params, request_id=f"kvpool-warmup-{index}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_stats()
    return time.perf_counter() - start
