"""Experiment 4: two requests share a prompt prefix through automatic prefix caching.

Request A's prompt is a 12-token system prompt plus its question; its full blocks are hashed
(chained on the parent block's hash) and published to the prefix cache as they fill. Request B
starts with the same system prompt: `SequenceBlocks.take_cached_prefix` finds A's first three
blocks by hash, takes a reference on each, and B allocates blocks only for the rest. The same
requests on a pool with prefix caching off show how many blocks sharing saves. A request with
a different `cache_salt` never shares, even with the same tokens.

Run: python -m kvpool.experiments.prefix_sharing
"""

from __future__ import annotations

from kvpool.memory import BlockPool, SequenceBlocks
from kvpool.memory.kv_layout import KVLayout

BLOCK_SIZE = 4
SYSTEM_PROMPT = "you are a helpful assistant . answer briefly and very politely ."  # 12 words
PROMPT_A = SYSTEM_PROMPT + " what is a kv cache ?"  # 18 tokens: 5 blocks, the last half full
PROMPT_B = SYSTEM_PROMPT + " why are blocks a fixed size ?"  # 19 tokens: 5 blocks


def tokenize(text: str, vocab: dict[str, int]) -> list[int]:
    """A toy tokenizer, one id per word: enough to make equal prefixes equal."""
    return [vocab.setdefault(word, len(vocab)) for word in text.split()]


def admit(pool: BlockPool, token_ids: list[int], cache_salt: str | None = None) -> SequenceBlocks:
    """What the scheduler does for a new request: reuse the cached prefix, append the rest."""
    table = SequenceBlocks(pool, cache_salt)
    num_cached_tokens = table.take_cached_prefix(token_ids)
    table.append_tokens(token_ids[num_cached_tokens:])  # computed: full blocks get published
    return table


def run(
    enable_prefix_caching: bool, prompts: list[list[int]]
) -> tuple[BlockPool, list[SequenceBlocks]]:
    """Admit every prompt into a fresh 32-block pool; returns the pool and the tables."""
    pool = BlockPool(32, KVLayout(BLOCK_SIZE), enable_prefix_caching=enable_prefix_caching)
    return pool, [admit(pool, prompt) for prompt in prompts]


def main() -> BlockPool:
    """Run the experiment; returns the prefix-caching pool so a caller can report on it."""
    vocab: dict[str, int] = {}
    prompt_a, prompt_b = tokenize(PROMPT_A, vocab), tokenize(PROMPT_B, vocab)

    pool, (table_a, table_b) = run(True, [prompt_a, prompt_b])
    shared_ids = [b for b in table_b.block_ids if b in table_a.block_ids]
    print(f"A: {table_a.num_tokens} tokens, blocks {table_a.block_ids}")
    print(f"B: {table_b.num_tokens} tokens, blocks {table_b.block_ids} "
          f"(shares {shared_ids} with A, ref_counts {[pool.ref_count(b) for b in shared_ids]})")
    stats = pool.stats()
    print(f"prefix cache: {stats.prefix_cache_hits_tokens} of {stats.prefix_cache_queries_tokens}"
          f" prompt tokens found cached (A found none, B its system prompt)")

    _, unshared_tables = run(False, [prompt_a, prompt_b])
    num_with = pool.num_used_blocks
    num_without = sum(table.num_blocks for table in unshared_tables)
    print(f"blocks used: {num_with} with sharing, {num_without} without: "
          f"{num_without - num_with} blocks saved")
    assert shared_ids == table_a.block_ids[:3] and (num_with, num_without) == (7, 10)

    salted = admit(pool, prompt_a, cache_salt="tenant-2")
    print(f"A's prompt under another cache_salt: blocks {salted.block_ids}, none shared")
    assert not set(salted.block_ids) & set(table_a.block_ids)

    for table in (table_a, table_b, salted):
        table.free()
    assert pool.num_used_blocks == 0
    print(f"all requests freed: {pool.num_cached_blocks} blocks stay cached for the next "
          f"request, {pool.num_free_blocks} are free")
    return pool


if __name__ == "__main__":
    main()
