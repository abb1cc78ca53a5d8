"""The tiers below a hybrid pool: each group's own host tier, swaps all or nothing across the
groups, restored tables, and copy order across groups that share device bytes."""

from __future__ import annotations

import torch

from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.hybrid_memory import HybridKVMemory
from kvpool.memory.kv_groups import kv_groups
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.sequence_blocks import SequenceBlocks
from kvpool.memory.tiers.host_tier import HostKVTier
from tests.memory.hybrid_checks import BLOCK_SIZE, gemma_like_groups

LAYER_BLOCK = BLOCK_SIZE * 2 * 8 * 4  # one layer's block: tokens * (K, V) * head_dim * float32


def memory_with_hosts(num_bytes: int, host_blocks: tuple[int, int] = (8, 8)) -> HybridKVMemory:
    """Full pages of 2 layer-blocks, sliding pages of 4 (window 8), a host tier per group."""
    groups = gemma_like_groups(window=8)
    layout = KVLayout(BLOCK_SIZE, 6, 1, 8, "float32")
    hosts = [[HostKVTier(group.layout, n)] for group, n in zip(groups, host_blocks, strict=True)]
    return HybridKVMemory(layout, groups, num_bytes, lower=hosts)


def test_a_page_one_group_spills_is_read_before_another_group_reloads_into_it():
    """Group 1 swaps a page out and gives it up; group 0 takes its bytes and swaps host KV
    into them, in the same step. Every group's copy-outs run first, so group 1's host copy
    holds group 1's KV, not what group 0 wrote over it."""
    memory = memory_with_hosts(6 * LAYER_BLOCK)  # one page of each group
    hybrid, cache, tiers = memory.hybrid, memory.kv_cache, memory.tiers.groups
    assert hybrid.make_allocatable([0, 1])
    [page] = hybrid.pools[1].allocate(1)
    cache.tensors[1][page] = 7.0
    [host_1] = tiers[1].swap_out([page])
    hybrid.pools[1].free([page])
    assert hybrid.make_allocatable([3, 0])  # the free page goes back to the arena, reused
    pages = hybrid.pools[0].allocate(3)
    host_0 = tiers[0].host.pool.allocate(3)
    tiers[0].host.kv_cache.tensor[host_0] = 3.0
    tiers[0].swap_in(host_0, pages)
    memory.tiers.before_step()
    assert bool((tiers[1].host.kv_cache.tensor[host_1] == 7.0).all())
    assert bool((cache.tensors[0][pages] == 3.0).all())
    tiers[1].free_swapped([host_1])
    hybrid.pools[0].free(pages)
    memory.check_invariants()


def test_a_swap_takes_every_groups_host_blocks_or_none():
    memory = memory_with_hosts(1 << 16, host_blocks=(8, 1))
    seq = SequenceBlocks(memory.hybrid)
    seq.append_tokens(list(range(10)))  # 3 blocks in each group: the sliding host holds 1
    assert memory.swap_out(seq.table) is None
    assert [t.host.pool.num_used_blocks for t in memory.tiers.groups] == [0, 0]
    seq.free()
    memory.check_invariants()


def test_a_swapped_table_comes_back_with_its_window_and_its_kv():
    memory = memory_with_hosts(1 << 16)
    seq = SequenceBlocks(memory.hybrid)
    seq.append_tokens(list(range(30)))
    seq.append_tokens([30])  # the window (8 tokens) drops the blocks before token 23
    table = seq.table
    dropped = [t.num_dropped_blocks for t in table.tables]
    assert dropped[0] == 0 and dropped[1] > 0
    for group, ids in enumerate(table.group_block_ids):
        for position, block_id in enumerate(ids):
            if block_id != NULL_BLOCK_ID:
                memory.kv_cache.tensors[group][block_id] = float(position + 1)
    swapped = memory.swap_out(table)
    assert swapped.num_dropped == tuple(dropped)
    num_tokens, token_ids, hashes = table.num_tokens, list(seq.token_ids), seq.block_hashes
    table.free()
    memory.tiers.before_step()  # the copies out
    back = memory.new_block_table()
    prefix, demand = memory.plan_swap_in(swapped, [], [], num_tokens)
    assert memory.grow_until_allocatable(demand)
    memory.swap_in(back, swapped, prefix, num_tokens)
    back.mark_computed(num_tokens, lambda start, end: token_ids[start:end], hashes)
    back.check()  # (what the KV manager does next: the tables agree again)
    memory.tiers.before_step()  # the copies in
    for group, ids in enumerate(back.group_block_ids):
        assert ids[: dropped[group]] == [NULL_BLOCK_ID] * dropped[group]
        for position in range(dropped[group], len(ids)):
            kv = memory.kv_cache.tensors[group][ids[position]]
            assert bool((kv == float(position + 1)).all()), (group, position)
    back.free()
    memory.check_invariants()
    assert all(t.host.pool.num_used_blocks == 0 for t in memory.tiers.groups)
    torch.testing.assert_close(memory.kv_cache.tensors[0][0],
                               torch.zeros_like(memory.kv_cache.tensors[0][0]))


def test_a_page_from_another_group_is_cleared_after_its_copy_out_and_before_any_write():
    """fp8 codes and float32 scales over one buffer: a page group 1 gave up holds bytes that
    read as NaN in group 0's layout. The step's preparation copies group 1's spill out first,
    then zeroes the page (codes and scales) for group 0, then copies in."""
    layout = KVLayout(BLOCK_SIZE, 6, 1, 8, "float8_e4m3fn")
    groups = kv_groups(layout, [None if (i + 1) % 3 == 0 else 8 for i in range(6)])
    memory = HybridKVMemory(layout, groups, sum(g.page_bytes for g in groups),
                            lower=[[HostKVTier(g.layout, 4)] for g in groups])
    hybrid, cache, tiers = memory.hybrid, memory.kv_cache, memory.tiers.groups
    assert hybrid.make_allocatable([0, 1])
    [page] = hybrid.pools[1].allocate(1)
    cache.buffer[page * hybrid.unit:][:groups[1].page_bytes] = 0xFF  # NaN as fp8 and float32
    [host_1] = tiers[1].swap_out([page])
    hybrid.pools[1].free([page])
    assert hybrid.make_allocatable([2, 0])  # group 0 takes the bytes back
    pages = hybrid.pools[0].allocate(2)
    memory.before_step()
    host = tiers[1].host.kv_cache
    assert bool((host.tensor[host_1].view(torch.uint8) == 0xFF).all())  # copied out first
    for block_id in pages:
        assert not cache.tensors[0][block_id].float().isnan().any()
        assert bool((cache.scale_tensors[0][block_id] == 0).all())
    tiers[1].free_swapped([host_1])
    hybrid.pools[0].free(pages)
    memory.check_invariants()
