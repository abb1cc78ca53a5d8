"""`LLMEngine.memory_stats()`: the block pool's snapshot plus what only the engine knows, the
longest request it serves, and so how many such requests the pool holds at once."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvpool.memory.block_pool import BlockPoolStats


@dataclass(frozen=True, slots=True)
class MemoryStats(BlockPoolStats):
    """`BlockPoolStats`, and `max_concurrency`: requests of `max_model_len` tokens that fit
    at once in the pool at its largest (`max_num_blocks`: an elastic pool's ceiling), the
    figure vLLM logs at start-up as "Maximum concurrency"."""

    max_model_len: int
    max_num_blocks: int
    max_concurrency: float

    @classmethod
    def of(cls, pool: BlockPoolStats, max_num_blocks: int, max_model_len: int,
           max_concurrency: float) -> MemoryStats:
        base = {field.name: getattr(pool, field.name) for field in fields(BlockPoolStats)}
        return cls(**base, max_model_len=max_model_len, max_num_blocks=max_num_blocks,
                   max_concurrency=max_concurrency)
