"""KV cache groups: how layers are grouped, and the capacity arithmetic that follows."""

from __future__ import annotations

import pytest

from kvpool.memory.kv_groups import FULL, SLIDING, bytes_for_tokens, kv_groups, max_concurrency
from kvpool.memory.kv_layout import KVLayout

GEMMA3_1B = KVLayout(16, 26, 1, 256, "bfloat16")
GEMMA3_1B_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]


def test_layers_group_by_window_full_first():
    full, sliding = kv_groups(GEMMA3_1B, GEMMA3_1B_WINDOWS)
    assert (full.kind, full.layers) == (FULL, (5, 11, 17, 23))
    assert sliding.kind == SLIDING and sliding.window == 512 and len(sliding.layers) == 22
    assert full.layout.num_layers == 4 and sliding.layout.num_layers == 22
    assert sliding.layout.bytes_per_block == 22 * GEMMA3_1B.bytes_per_block // 26


def test_hybrid_off_and_windows_past_the_context_are_one_full_group():
    (only,) = kv_groups(GEMMA3_1B, GEMMA3_1B_WINDOWS, hybrid=False)
    assert only.window is None and only.layers == tuple(range(26))
    (only,) = kv_groups(GEMMA3_1B, GEMMA3_1B_WINDOWS, max_model_len=512)
    assert only.window is None


def test_a_window_holds_its_blocks_and_one_more_at_most():
    _, sliding = kv_groups(GEMMA3_1B, GEMMA3_1B_WINDOWS)
    assert sliding.max_live_blocks == 33
    held = [sliding.max_blocks_held(n) for n in range(1, 5000)]
    assert max(held) == 33 and held[:32] == [1] * 16 + [2] * 16
    # A prompt computed at once holds every block for the step.
    assert sliding.max_blocks_held(4096, num_query_tokens=4096) == 256


@pytest.mark.parametrize(("max_model_len", "expected"), [(4096, 6656 / 1728),
                                                         (8192, 13312 / 2752),
                                                         (32768, 53248 / 8896)])
def test_gemma3_1b_holds_four_to_six_times_the_requests(max_model_len, expected):
    hybrid = kv_groups(GEMMA3_1B, GEMMA3_1B_WINDOWS)
    padded = kv_groups(GEMMA3_1B, GEMMA3_1B_WINDOWS, hybrid=False)
    budget = 2**30
    ratio = max_concurrency(hybrid, budget, max_model_len) / max_concurrency(
        padded, budget, max_model_len)
    assert ratio == pytest.approx(expected)
    assert max_concurrency(padded, budget, max_model_len) == pytest.approx(
        GEMMA3_1B.max_concurrency(budget // GEMMA3_1B.bytes_per_block, max_model_len), rel=1e-3)
    assert bytes_for_tokens(padded, max_model_len) == (
        GEMMA3_1B.num_blocks_for_tokens(max_model_len) * GEMMA3_1B.bytes_per_block)


def test_bad_groupings_are_refused():
    with pytest.raises(ValueError, match="26 layers"):
        kv_groups(GEMMA3_1B, [None] * 3)
    with pytest.raises(ValueError, match="at least 1 token"):
        kv_groups(GEMMA3_1B, [0] * 26)
