"""The start-up summary `kvpool serve` logs once the engine is built, as vLLM logs its KV
cache size and maximum concurrency: the model, its dtype, the KV cache's dtype, the KV pool's
size in blocks and tokens, and how many requests of `max_model_len` tokens fit at once.

Maximum concurrency is vLLM's figure, `memory_stats().max_concurrency` (its owner is the KV
memory: `KVLayout.max_concurrency` with one KV cache group, `kv_groups.max_concurrency` with a
sliding-window group, whose requests hold only their window's blocks there): the requests of
max_model_len tokens, each decoding, that fit at once (shorter ones fit more). It counts the
device pool at its largest only: a host tier holds swapped-out requests, not running ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpool.engine.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class StartupSummary:
    model: str
    dtype: str
    kv_cache_dtype: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_concurrency: float

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def line(self) -> str:
        return (f"model {self.model}, dtype {self.dtype}, KV cache dtype {self.kv_cache_dtype}; "
                f"KV cache: {self.num_kv_blocks:,} blocks of {self.block_size} tokens = "
                f"{self.num_kv_tokens:,} tokens; maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")


def startup_summary(engine: LLMEngine, model_name: str) -> StartupSummary:
    """The summary of a built engine serving `model_name`."""
    pool = engine.memory_stats()
    return StartupSummary(
        model=model_name,
        dtype=str(engine.dtype).removeprefix("torch."),
        kv_cache_dtype=pool.kv_cache_dtype,
        num_kv_blocks=pool.max_num_blocks,
        block_size=pool.block_size,
        max_model_len=pool.max_model_len,
        max_concurrency=pool.max_concurrency,
    )


def log_startup_summary(engine: LLMEngine, model_name: str) -> StartupSummary:
    """Log the summary on uvicorn's logger (configured by then, at --log-level); return it."""
    summary = startup_summary(engine, model_name)
    logging.getLogger("uvicorn.error").info("kvpool: %s", summary.line())
    return summary
