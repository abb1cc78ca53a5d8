"""The snapshot summary and the pool map: exact figures from a real engine whose request forks
(n=2, so its prompt blocks are shared), a 100,000-block map drawn in reasonable time, and a
producer's leased blocks in their own colour and figure."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts
from kvpool.formats.kv_snapshot import (
    CACHED,
    FREE,
    OFFLINE,
    USED,
    BlockRun,
    DerivedFigures,
    KVSnapshot,
    PoolView,
    SequenceView,
)
from kvpool.inspect.palette import BLOCK_COLOURS, LEASED_COLOUR
from kvpool.inspect.pool_map import _pool_image, draw_pool_map, grid_shape
from kvpool.inspect.summary import format_summary, summary_json
from kvpool.memory.block_pool import BlockPoolStats

FORKED = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def snapshot(smollm2) -> Iterator[KVSnapshot]:
    """Mid-run: a cached 40-token prompt, then a 40-token request with n=2 after its prefill
    and one decode step (its two sequences share their 2 full prompt blocks; the first
    decode gave each a private copy of the partial tail)."""
    config = EngineConfig(num_gpu_blocks=32, enable_warmup=False)
    engine = LLMEngine(config, build_engine_parts(config, smollm2))
    engine.add_request({"prompt_token_ids": list(range(500, 540))},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), "warm")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request({"prompt_token_ids": list(range(100, 140))}, FORKED, "forked")
    engine.step()
    engine.step()
    yield engine.kv_snapshot()
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()


def test_the_figures_add_up(snapshot) -> None:
    figures = summary_json(snapshot)
    device = figures["pools"]["device"]
    assert device["num_blocks"] == 32
    counts = device["counts"]
    assert counts[USED] == 4  # 2 shared prompt blocks, 2 private tails
    assert counts[CACHED] == 2  # the warm prompt's full blocks
    assert counts[FREE] == 26 and counts[OFFLINE] == 1
    assert device["bytes"][USED] == 4 * snapshot.device.bytes_per_block
    [holder] = figures["holders"]
    assert holder["request_id"] == "forked" and holder["num_sequences"] == 2
    assert holder["num_blocks_held"] == 6  # each sequence lists 3 blocks
    assert holder["num_blocks_share"] == pytest.approx(4.0)  # shares add up to the used blocks
    [shared] = figures["shared"]
    assert shared == {"num_blocks": 2, "sequences": ["forked#0", "forked#1"],
                      "positions": [0, 1], "is_prefix": True}
    assert [row["block_id"] for row in figures["oldest_cached"]] == list(snapshot.device.lru)
    assert figures["derived"]["num_shared_blocks"] == 2


def test_the_text_says_what_cached_means_and_who_holds_what(snapshot) -> None:
    text = format_summary(snapshot)
    assert "device pool: 32 blocks x 16 tokens" in text
    assert "not leaked" in text and "evicted LRU" in text
    assert "a block shared by k sequences counts 1/k to each" in text
    assert "forked" in text and "2 seq(s): 2 running" in text
    assert "2 block(s) (a shared prefix 0-1 of forked#0) held by forked#0, forked#1" in text
    assert "oldest cached blocks (the LRU head" in text
    assert "host tier" not in text


def test_the_pool_map_of_a_small_pool_is_a_png(snapshot, tmp_path) -> None:
    path = draw_pool_map(snapshot, tmp_path / "pool.png")
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 600


def synthetic_snapshot(num_blocks: int) -> KVSnapshot:
    """A pool of `num_blocks` online blocks in a repeating pattern of every state."""
    runs, first = [BlockRun(0, 1, OFFLINE, 0, 0)], 1
    pattern = [(USED, 1, 7), (USED, 2, 3), (CACHED, 0, 5), (FREE, 0, 11)]
    while first <= num_blocks:
        for state, ref_count, count in pattern:
            count = min(count, num_blocks + 1 - first)
            if count > 0:
                holders = (0, 1)[:ref_count]
                runs.append(BlockRun(first, count, state, ref_count, 16, holders))
                first += count
    view = PoolView(16, num_blocks, num_blocks + 1, 36864, "bfloat16", tuple(runs), {},
                    ((1, num_blocks, 1.0),), ())
    used = view.count(USED)
    stats = BlockPoolStats(num_blocks, 16, "bfloat16", 36864, view.count(FREE), used,
                           view.count(CACHED), used / num_blocks, 0, used, 0, 0, 0, 0, 0, 0)
    derived = DerivedFigures(0.0, view.count(FREE), 0.0, 0.0, 0.0, 0.2, 0.3, 1)
    sequences = tuple(SequenceView(f"req-{i}", 0, "running", 16, 16, ()) for i in range(2))
    return KVSnapshot(time.time(), 7, {"device": view, "host": view}, sequences, stats, derived)


def test_a_100k_block_pool_map_draws_in_reasonable_time(tmp_path) -> None:
    snapshot = synthetic_snapshot(100_000)
    start = time.perf_counter()
    path = draw_pool_map(snapshot, tmp_path / "big.png")
    assert time.perf_counter() - start < 15
    image = imread(path)
    rows, columns = grid_shape(100_001)
    assert columns == 448 and rows == 224
    assert image.shape[1] >= columns * 3  # every block gets pixels of its own
    assert "host tier: 100000 blocks" in format_summary(snapshot)


def test_the_grid_is_64_wide_for_small_pools() -> None:
    assert grid_shape(33) == (1, 64)
    assert grid_shape(2048) == (32, 64)
    assert np.prod(grid_shape(2049)) >= 2049


def test_leased_blocks_take_the_lease_colour_and_are_counted() -> None:
    """Blocks 1-2 held by a lease alone, block 3 by a sequence and a lease, 4 by a sequence."""
    runs = (BlockRun(0, 1, OFFLINE, 0, 0), BlockRun(1, 2, USED, 1, 16),
            BlockRun(3, 1, USED, 2, 16, (0,)), BlockRun(4, 1, USED, 1, 16, (0,)),
            BlockRun(5, 3, FREE, 0, 0))
    view = PoolView(16, 7, 8, 36864, "bfloat16", runs, {}, ((1, 7, 1.0),), (),
                    leases={1: 1, 2: 1, 3: 1})
    image = _pool_image(view)
    cell = image.shape[0]  # one row of 64 cells

    def colour(block_id: int) -> tuple[float, ...]:
        return tuple(image[0, block_id * cell])  # the top-left corner, clear of the marks

    assert [colour(b) for b in (1, 2, 3)] == [to_rgb(LEASED_COLOUR)] * 3
    assert colour(4) == to_rgb(BLOCK_COLOURS[USED]) and colour(5) == to_rgb(BLOCK_COLOURS[FREE])
    stats = BlockPoolStats(7, 16, "bfloat16", 36864, 3, 4, 0, 4 / 7, 0, 4, 0, 0, 0, 0, 0, 0)
    derived = DerivedFigures(0.0, 3, 0.0, 0.0, 0.0, 0.0, 0.25, 1, num_leased_blocks=3)
    sequences = (SequenceView("req-0", 0, "running", 32, 32, (3, 4)),)
    snapshot = KVSnapshot(time.time(), 1, {"device": view}, sequences, stats, derived)
    assert "leased 3 blocks, kept for decode workers to read" in format_summary(snapshot)
