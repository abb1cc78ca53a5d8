"""The disk KV tier on real files: round trips per dtype, restarts, rejection of bad files, LRU
order (across restarts too), a full disk, the pending-bytes bound and the writer. The file
format alone is test_disk_block_format; the state machine is test_disk_tier_machine."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from disk_checks import (
    BIG,
    DTYPES,
    NAMESPACE,
    Gate,
    block_file,
    file_size,
    make_block,
    make_layout,
    same_bits,
    stored_tier,
)

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.tiers.disk_tier import DiskKVTier


def warnings_from_tier(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "kvpool.memory.tiers.disk_tier" and r.levelno == logging.WARNING]


# ---------------------------------------------------------------- round trips, restart
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(tmp_path, dtype):
    layout = make_layout(dtype)
    tier = stored_tier(tmp_path, layout, [1])
    block_hash, tokens, kv, scales = make_block(layout, 1)
    assert tier.contains(block_hash)
    block = tier.load(block_hash, tokens)
    assert block is not None and same_bits(block.kv, kv) and same_bits(block.scales, scales)
    assert block.kv.device.type == "cpu" and block.kv.is_contiguous()
    assert (block.scales is not None) == layout.is_quantized
    stats = tier.stats()
    assert stats.num_stored_blocks == stats.num_loaded_blocks == stats.num_files == 1
    assert stats.num_stored_bytes == stats.num_loaded_bytes == stats.num_bytes
    assert block_file(tier, block_hash).stat().st_size == stats.num_bytes
    tier.check_invariants()
    tier.close()


def test_restart_finds_the_blocks_and_other_namespaces_find_nothing(tmp_path):
    layout = make_layout("int8")
    stored_tier(tmp_path, layout, [1, 2, 3]).close()
    again = DiskKVTier(tmp_path / "disk", BIG, layout, NAMESPACE)
    assert again.stats().num_files == 3
    for key in (1, 2, 3):
        block_hash, tokens, kv, scales = make_block(layout, key)
        block = again.load(block_hash, tokens)
        assert block is not None and same_bits(block.kv, kv) and same_bits(block.scales, scales)
    again.check_invariants()
    other = DiskKVTier(tmp_path / "disk", BIG, layout, "models/other|layout-a")
    block_hash, tokens, *_ = make_block(layout, 1)
    assert other.stats().num_files == 0 and not other.contains(block_hash)
    assert other.load(block_hash, tokens) is None
    other.check_invariants()


def test_start_up_deletes_stray_temp_files_and_misnamed_block_files(tmp_path):
    layout = make_layout()
    tier = stored_tier(tmp_path, layout, [1])
    tier.close()
    path = block_file(tier, make_block(layout, 1)[0])
    shard = path.parent
    (shard / "leftover.123.tmp").write_bytes(b"half a block")
    (shard / "not-a-hash.safetensors").write_bytes(b"junk")
    again = DiskKVTier(tmp_path / "disk", BIG, layout, NAMESPACE)
    assert [p.name for p in shard.iterdir()] == [path.name]
    assert again.stats().num_files == 1 and again.stats().num_rejected_files == 1
    again.check_invariants()


# ---------------------------------------------------------------- rejection
def corrupt(tmp_path: Path, tier: DiskKVTier, how: str, layout: KVLayout) -> list[int]:
    """Damage block 1's file in place; the token ids to load it with."""
    block_hash, tokens, *_ = make_block(layout, 1)
    path = block_file(tier, block_hash)
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped_byte":
        data[-7] ^= 0x10  # in the tensor payload, which safetensors does not check
        path.write_bytes(data)
    elif how in ("other_namespace", "other_layout"):
        other_layout = make_layout("bfloat16") if how == "other_layout" else layout
        namespace = NAMESPACE if how == "other_layout" else "models/other|layout-a"
        other = DiskKVTier(tmp_path / "other", BIG, other_layout, namespace)
        other.store(*make_block(other_layout, 1))
        other.close()
        shutil.copyfile(block_file(other, block_hash), path)
    elif how == "other_hash":  # a valid file of this namespace, under another block's name
        shutil.copyfile(block_file(tier, make_block(layout, 2)[0]), path)
    elif how == "wrong_tokens":
        return [*tokens[:-1], tokens[-1] + 1]
    return tokens


@pytest.mark.parametrize("how", ["truncated", "flipped_byte", "other_namespace", "other_layout",
                                 "other_hash", "wrong_tokens"])
def test_a_bad_file_is_rejected_deleted_and_never_served(tmp_path, how):
    layout = make_layout()
    tier = stored_tier(tmp_path, layout, [1, 2])
    tokens = corrupt(tmp_path, tier, how, layout)
    block_hash = make_block(layout, 1)[0]
    assert tier.load(block_hash, tokens) is None
    stats = tier.stats()
    assert stats.num_rejected_files == 1 and stats.num_loaded_blocks == 0 and stats.num_files == 1
    assert not block_file(tier, block_hash).exists() and not tier.contains(block_hash)
    assert tier.load(block_hash, make_block(layout, 1)[1]) is None  # now a plain miss
    assert tier.stats().num_rejected_files == 1
    tier.check_invariants()
    assert tier.load(*make_block(layout, 2)[:2]) is not None  # the other block is untouched


def test_a_file_deleted_behind_the_tiers_back_is_a_rejected_miss(tmp_path):
    layout = make_layout()
    tier = stored_tier(tmp_path, layout, [1])
    block_hash, tokens, *_ = make_block(layout, 1)
    block_file(tier, block_hash).unlink()
    assert tier.load(block_hash, tokens) is None
    assert tier.stats().num_rejected_files == 1 and not tier.contains(block_hash)
    tier.check_invariants()


# ---------------------------------------------------------------- LRU
def test_lru_evicts_the_least_recently_used_and_the_order_survives_restart(tmp_path):
    layout = make_layout()
    capacity = 3 * file_size(tmp_path, layout)
    hashes = {key: make_block(layout, key)[0] for key in range(1, 6)}
    tier = stored_tier(tmp_path, layout, [1, 2, 3], capacity=capacity)
    assert tier.load(*make_block(layout, 1)[:2]) is not None  # 1 is now the most recent
    tier.store(*make_block(layout, 4))
    tier.flush()
    assert [key for key in hashes if tier.contains(hashes[key])] == [1, 3, 4]
    assert tier.stats().num_evicted_files == 1 and not block_file(tier, hashes[2]).exists()
    tier.check_invariants()
    tier.close()
    # LRU order is now 3, 1, 4: a restart must see the same, even with a smaller budget.
    again = DiskKVTier(tmp_path / "disk", capacity, layout, NAMESPACE)
    again.store(*make_block(layout, 5))
    again.flush()
    assert [key for key in hashes if again.contains(hashes[key])] == [1, 4, 5]
    again.close()
    smaller = DiskKVTier(tmp_path / "disk", capacity // 3, layout, NAMESPACE)
    assert [key for key in hashes if smaller.contains(hashes[key])] == [5]
    assert smaller.stats().num_evicted_files == 2
    smaller.check_invariants()


def test_a_block_bigger_than_the_capacity_is_not_stored(tmp_path):
    layout = make_layout()
    tier = stored_tier(tmp_path, layout, [1], capacity=layout.bytes_per_block)  # + the header
    stats = tier.stats()
    assert stats.num_files == 0 and stats.num_stored_blocks == 0 and stats.is_enabled
    tier.check_invariants()


# ---------------------------------------------------------------- failures
@pytest.fixture
def small_disk(tmpfs):
    """A 256 KiB tmpfs, mounted for the test and unmounted after it."""
    return tmpfs("256k")


def test_a_full_disk_switches_the_tier_off_with_one_warning(small_disk, caplog):
    layout = make_layout(head_dim=256)  # 32 KiB blocks: 7 fit
    tier = DiskKVTier(small_disk, BIG, layout, NAMESPACE)
    with caplog.at_level(logging.WARNING, logger="kvpool.memory.tiers.disk_tier"):
        for key in range(20):
            tier.store(*make_block(layout, key))
            tier.flush()
    stats = tier.stats()
    assert not stats.is_enabled and stats.num_write_errors == 1
    assert 0 < stats.num_stored_blocks < 20 and stats.num_files == stats.num_stored_blocks
    (warning,) = warnings_from_tier(caplog)
    assert "off from now on" in warning.getMessage() and "No space left" in warning.getMessage()
    tier.check_invariants()  # the partial temp file is gone
    written = make_block(layout, 0)
    assert not tier.contains(written[0]) and tier.load(*written[:2]) is None  # off: no loads
    tier.store(*make_block(layout, 99))
    tier.flush()
    assert tier.stats() == stats  # a no-op
    tier.close()
    again = DiskKVTier(small_disk, BIG, layout, NAMESPACE)  # the next process serves them
    assert again.stats().num_files == stats.num_files and again.load(*written[:2]) is not None
    again.close()


def test_an_unusable_directory_starts_the_tier_off(tmp_path, caplog):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        DiskKVTier(tmp_path / "a_file", BIG, make_layout(), NAMESPACE)
    with caplog.at_level(logging.WARNING, logger="kvpool.memory.tiers.disk_tier"):
        tier = DiskKVTier(tmp_path / "a_file" / "below", BIG, make_layout(), NAMESPACE)
    assert len(warnings_from_tier(caplog)) == 1 and not tier.stats().is_enabled
    tier.store(*make_block(make_layout(), 1))
    tier.flush()
    assert tier.stats().num_files == 0 and not tier.contains(make_block(make_layout(), 1)[0])
    tier.check_invariants()
    tier.close()
    tier.close()  # idempotent


def test_store_refuses_tensors_that_do_not_fit_the_layout(tmp_path):
    layout = make_layout("int8")
    tier = DiskKVTier(tmp_path, BIG, layout, NAMESPACE)
    block_hash, tokens, kv, scales = make_block(layout, 1)
    with pytest.raises(AssertionError):
        tier.store(block_hash, tokens, kv.float(), scales)
    with pytest.raises(AssertionError):
        tier.store(block_hash, tokens, kv, None)
    with pytest.raises(AssertionError):
        tier.store(block_hash[:8], tokens, kv, scales)
    tier.close()


# ---------------------------------------------------------------- the writer
def test_stores_past_the_pending_bound_are_dropped_and_counted(tmp_path):
    layout = make_layout()
    tier = DiskKVTier(tmp_path, BIG, layout, NAMESPACE,
                      max_pending_bytes=layout.bytes_per_block * 3 // 2)
    gate = Gate()
    first, second = make_block(layout, 1), make_block(layout, 2)
    tier.store(*first, ready=gate)  # the writer waits on the gate with it
    tier.store(*second)
    tier.store(*first)  # already queued: skipped, not dropped
    assert tier.stats().num_dropped_writes == 1 and not tier.contains(first[0])
    gate.open()
    tier.flush()
    assert tier.contains(first[0]) and not tier.contains(second[0])
    tier.store(*second)  # the queue has room again
    tier.flush()
    assert tier.contains(second[0]) and tier.stats().num_dropped_writes == 1
    tier.check_invariants()
    tier.close()
    tier.store(*make_block(layout, 3))  # after close: a no-op
    assert tier.stats().num_files == 2


def test_the_writer_reads_the_tensors_only_once_ready(tmp_path):
    """The caller's async copy fills the tensors after `store` returns; `ready` says when."""
    layout = make_layout("float8_e4m3fn")
    block_hash, tokens, kv, scales = make_block(layout, 1)
    landing_kv, landing_scales = torch.zeros_like(kv), torch.zeros_like(scales)
    tier = DiskKVTier(tmp_path, BIG, layout, NAMESPACE)
    gate = Gate()
    tier.store(block_hash, tokens, landing_kv, landing_scales, ready=gate)
    landing_kv.copy_(kv)
    landing_scales.copy_(scales)
    gate.open()
    tier.flush()
    block = tier.load(block_hash, tokens)
    assert block is not None and same_bits(block.kv, kv) and same_bits(block.scales, scales)
    tier.close()


def test_rows_of_a_batch_snapshot_round_trip(tmp_path):
    """The engine stores rows (views) of one host snapshot of many blocks."""
    layout = make_layout("int8")
    blocks = [make_block(layout, key) for key in range(3)]
    kv = torch.stack([block[2] for block in blocks])  # [num_blocks, *layout.block_shape]
    scales = torch.stack([block[3] for block in blocks])
    tier = DiskKVTier(tmp_path, BIG, layout, NAMESPACE)
    for row, (block_hash, tokens, _, _) in enumerate(blocks):
        tier.store(block_hash, tokens, kv[row], scales[row])
    tier.flush()
    for block_hash, tokens, block_kv, block_scales in blocks:
        block = tier.load(block_hash, tokens)
        assert block is not None and same_bits(block.kv, block_kv)
        assert same_bits(block.scales, block_scales)
    tier.close()
