"""`BlockPoolStats`: what a block pool reports about itself (`BlockPool.stats()`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockPoolStats:
    """A snapshot of the pool; every count is in blocks unless its name says otherwise."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str  # the storage dtype's name ("int8", "float8_e4m3fn", "bfloat16", ...)
    bytes_per_block: int  # K/V codes and, for int8 / fp8, their scales
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    usage: float  # used / total
    num_unfilled_slots: int  # reserved in used blocks but not yet holding a token
    num_allocations: int  # blocks that left free/cached (fresh, evicted, or cached and revived)
    num_frees: int  # blocks that came back; allocations - frees == used since the last reset
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    prefix_cache_queries_blocks: int
    prefix_cache_hits_blocks: int
    num_evictions: int
