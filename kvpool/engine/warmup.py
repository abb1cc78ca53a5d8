"""Start-up warm-up: one dummy batch, so the first real request pays no first-use costs.

What a first batch pays and later ones do not: operators dispatched and kernels loaded for the
first time (on CUDA: Triton kernels compiled — every variant a later step can launch, split
decode included, by the Triton backend's first call: `kvpool.attention.triton_backend` —
cuBLAS handles and workspaces made), torch's
allocator growing its pools, the tokenizer's first decode, the sampler's sort and log-softmax
paths. The warm-up pays them at start-up instead.

The dummy batch: two sequences whose prompts (of different lengths, so padding is exercised)
and outputs stay inside one block, so no full block is published to the prefix cache. One is
greedy with logprobs, the other samples with top-k/top-p from its own seed, so the sampler's
shared random stream is left untouched. The first step prefills both, the second decodes both.
With a host tier and `preemption_mode="auto"`, the warm-up also measures what the preemption
policy compares (`kvpool.engine.preemption`): device↔host copy bandwidth over the tier's real
block copies, and the prefill FLOP rate of one `RATE_PROMPT_TOKENS`-token prompt.

The warm-up drives the engine through its public request API only (`WarmUpTarget`) and
measures on the parts it was built from (`EngineParts`, the runner, the preemption policy).

Afterwards `engine.reset_stats()` puts the KV pool back to its start-up state (no cached block,
free blocks in their first order, elastic segments grown for the batch given back) and zeroes
every engine, scheduler and pool counter: the engine reads as if nothing ran.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch

from kvpool.engine.model_runner import SequenceChunk
from kvpool.engine.preemption import TransferRates, measure_copy_bandwidth
from kvpool.engine.sampling_params import SamplingParams
from kvpool.memory.tiers.kv_transfer import copy_block
from kvpool.model.flops import prefill_flops

if TYPE_CHECKING:
    from kvpool.engine.model_runner import ModelRunner
    from kvpool.engine.preemption import PreemptionPolicy
    from kvpool.engine.setup import EngineParts

MAX_PROMPT_TOKENS = 8
NUM_OUTPUT_TOKENS = 2  # the first comes from the prefill step, the second from a decode step
RATE_PROMPT_TOKENS = 256  # the prefill-rate measurement's prompt
RATE_COPY_BLOCKS = 16  # blocks each way in the copy-bandwidth measurement


class WarmUpTarget(Protocol):
    """The part of an engine a warm-up drives."""

    def add_request(self, prompt: list[int], params: SamplingParams,
                    request_id: str | None = None) -> object: ...

    def step(self) -> list: ...

    def has_unfinished_requests(self) -> bool: ...

    def reset_stats(self) -> None: ...


def warm_up(engine: WarmUpTarget, parts: EngineParts, runner: ModelRunner,
            policy: PreemptionPolicy) -> float:
    """Run the dummy batch on `engine` (built from `parts`), measure `policy`'s rates when it
    chooses, then reset the engine's statistics; returns the seconds taken."""
    start = time.perf_counter()
    # Prompt + first output token must leave the block unfilled (block_size - 2 at most).
    block_size = parts.kv_memory.layout.block_size
    prompt_len = min(MAX_PROMPT_TOKENS, block_size - 2, parts.max_model_len - 2)
    prompt_len = max(1, prompt_len)
    if prompt_len >= parts.max_model_len:
        return 0.0  # a model too short to run even the dummy batch
    greedy = SamplingParams(temperature=0, max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True,
                            logprobs=1)
    sampled = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=0,
                             max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True)
    vocab_size = parts.model_config.vocab_size
    for index, params in enumerate((greedy, sampled)):
        num_tokens = max(1, prompt_len - index)
        token_ids = [(1 + token) % vocab_size for token in range(num_tokens)]
        engine.add_request(token_ids, params, request_id=f"kvpool-warmup-{index}")
    while engine.has_unfinished_requests():
        engine.step()
    if policy.mode == "auto" and parts.kv_memory.tiers.has_host:
        policy.rates = measure_transfer_rates(parts, runner)
    engine.reset_stats()
    return time.perf_counter() - start


def measure_transfer_rates(parts: EngineParts, runner: ModelRunner) -> TransferRates:
    """Device→host and host→device bytes/s, and prefill FLOP/s, on an engine's pools and
    model (with no request running: the blocks it uses are free)."""
    memory = parts.kv_memory
    pool, device, host = memory.pool, memory.kv_cache, memory.tiers.host
    num_blocks = min(RATE_COPY_BLOCKS, pool.num_allocatable_blocks, host.pool.num_free_blocks)
    device_ids = pool.allocate(num_blocks)
    host_ids = host.pool.allocate(num_blocks)
    bytes_moved = num_blocks * pool.layout.bytes_per_block  # (a hybrid pool: its first group's)

    def copy(dst, dst_ids, src, src_ids) -> int:
        for dst_id, src_id in zip(dst_ids, src_ids, strict=True):
            copy_block(dst, dst_id, src, src_id, non_blocking=False)
        return bytes_moved

    to_host = measure_copy_bandwidth(lambda: copy(host.kv_cache, host_ids, device, device_ids))
    to_device = measure_copy_bandwidth(lambda: copy(device, device_ids, host.kv_cache, host_ids))
    host.pool.free(host_ids)
    pool.free(device_ids)
    return TransferRates(to_host, to_device, _prefill_flops_per_s(parts, runner))


def _prefill_flops_per_s(parts: EngineParts, runner: ModelRunner) -> float:
    """FLOP/s of one prompt's prefill (best of two), in a block table of the KV memory's."""
    memory = parts.kv_memory
    table = memory.new_block_table()
    num_tokens = min(RATE_PROMPT_TOKENS, parts.max_model_len - 1)
    while num_tokens > 1 and not memory.grow_until_allocatable(memory.demand(table, num_tokens)):
        num_tokens //= 2
    table.append_slots(num_tokens)
    vocab_size = parts.model_config.vocab_size
    first, *others = table.group_block_ids
    chunk = SequenceChunk([(7 * token + 1) % vocab_size for token in range(num_tokens)], 0,
                          first, other_group_block_ids=tuple(others))
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        runner.execute([chunk])
        if parts.device.type == "cuda":
            torch.cuda.synchronize(parts.device)
        best = min(best, time.perf_counter() - start)
    table.free()
    return prefill_flops(parts.model_config, num_tokens) / best
