"""The Triton kernels equal the torch reference (`TorchAttentionBackend`, torch `write_kv`).

Without CUDA the kernels run in Triton's interpreter on CPU tensors. `TRITON_INTERPRET` is read
when `@triton.jit` decorates a function (Triton's own library functions included), so this
module sets it while it imports triton and the kernel modules — at collection, before any test
runs — and then restores the environment, so no subprocess inherits it. Inside this process
Triton stays in interpreter mode, the only mode its kernels can run in without CUDA
(`tests/attention/triton_interpreter.py`). With CUDA nothing is switched: the same tests run
the compiled kernels on the GPU, and the GPU-marked tests add realistic shapes in fp16/bf16 and
a whole greedy generation against the torch backend.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvpool.attention.kv_write import write_kv_reference, write_kv_triton
from kvpool.attention.metadata import PAD_SLOT_ID, AttentionMetadata
from kvpool.attention.torch_ref import TorchAttentionBackend
from kvpool.memory.kv_layout import QUANTIZED_CODE_MAX, KVLayout
from kvpool.memory.kv_quant import quantize
from tests.attention.triton_interpreter import (
    DEVICE,
    IS_INTERPRETED,
    import_kernels_for_the_interpreter,
)

if IS_INTERPRETED:
    import_kernels_for_the_interpreter()

from kvpool.attention import (  # after the interpreter switch
    triton_backend,
    triton_decode,
    triton_kv,
    triton_prefill,
)


@dataclass
class Batch:
    """A step's inputs: a paged cache holding every sequence's cached prefix, plus new tokens."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_layer: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata
    scale: float
    kv_scales: torch.Tensor | None = None  # [num_blocks, 2, block_size, num_kv_heads] (quantized)


QUANTIZED_KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
KV_DTYPE_IDS = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def kv_id(kv_dtype: torch.dtype) -> str:
    return KV_DTYPE_IDS[kv_dtype]


def make_batch(
    seq_shapes: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int = 2,
    group_size: int = 1,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    num_shared_blocks: int = 0,
    device: str = DEVICE,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> Batch:
    """seq_shapes: (num_cached_tokens, query_len) per sequence, decodes (query_len 1) first.

    Physical blocks are shuffled; unused slots hold random garbage the kernels must mask out.
    A quantized `kv_dtype` (int8 / fp8) makes the cache hold codes, with their scales.
    The first `num_shared_blocks` logical blocks of every sequence are the same physical blocks
    (a prefix-cache hit), so every cached prefix must cover them.
    """
    generator = torch.Generator().manual_seed(seed)
    num_seq_blocks = [-(-(cached + new) // block_size) for cached, new in seq_shapes]
    num_blocks = sum(num_seq_blocks) + 4
    free_ids = list(range(num_blocks))
    random.Random(seed).shuffle(free_ids)
    shared_ids = [free_ids.pop() for _ in range(num_shared_blocks)]
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    kv_cache_layer = torch.randn(shape, generator=generator)
    if kv_dtype is None:
        kv_cache_layer, kv_scales = kv_cache_layer.to(dtype), None
    else:
        kv_cache_layer, kv_scales = quantize(kv_cache_layer, kv_dtype)
        kv_scales = kv_scales.to(device)
    tables, slots = [], []
    for (cached, new), num_seq_block in zip(seq_shapes, num_seq_blocks, strict=True):
        assert cached >= num_shared_blocks * block_size
        table = shared_ids + [free_ids.pop() for _ in range(num_seq_block - num_shared_blocks)]
        tables.append(table)
        positions = range(cached, cached + new)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in positions)
    num_tokens = len(slots)
    num_heads = num_kv_heads * group_size
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    metadata = AttentionMetadata.build(
        query_lens=[new for _, new in seq_shapes],
        seq_lens=[cached + new for cached, new in seq_shapes],
        block_tables=tables,
        slot_mapping=slots,
        layout=KVLayout(block_size),
        device=device,
    )
    return Batch(
        query.to(device),
        key.to(device),
        value.to(device),
        kv_cache_layer.to(device),
        metadata,
        scale=head_dim**-0.5,
        kv_scales=kv_scales,
    )


def reference_with_scales(
    batch: Batch, sliding_window: int | None = None, logit_softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Output, updated cache and updated scales from the torch backend (on copies)."""
    kv_cache_layer = batch.kv_cache_layer.clone()
    kv_scales = None if batch.kv_scales is None else batch.kv_scales.clone()
    out = TorchAttentionBackend().forward(
        batch.query, batch.key, batch.value, kv_cache_layer, batch.metadata, batch.scale, kv_scales,
        sliding_window, logit_softcap,
    )
    return out, kv_cache_layer, kv_scales


def reference(
    batch: Batch, sliding_window: int | None = None, logit_softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and updated cache from the torch backend (on a copy of the cache)."""
    out, kv_cache_layer, _ = reference_with_scales(batch, sliding_window, logit_softcap)
    return out, kv_cache_layer


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit (fp8 tensors compared as bytes; torch.equal lacks float8)."""
    if actual.element_size() == 1:
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    assert torch.equal(actual, expected)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


# ---------------------------------------------------------------- KV write and block copy


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_write_kv_equals_torch(block_size):
    batch = make_batch([(3, 1), (0, 11), (block_size, 5)], block_size, num_kv_heads=3)
    expected = batch.kv_cache_layer.clone()
    write_kv_reference(expected, batch.key, batch.value, batch.metadata.slot_mapping)
    actual = batch.kv_cache_layer.clone()
    write_kv_triton(actual, batch.key, batch.value, batch.metadata.slot_mapping)
    assert torch.equal(actual, expected)


def test_write_kv_reads_strided_inputs_into_a_layer_view():
    # K and V as views of a fused qkv projection; the cache layer as a view of the 6-D tensor.
    num_tokens, num_kv_heads, head_dim, block_size = 5, 2, 16, 8
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim, device=DEVICE)
    key = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    cache = torch.zeros(4, 3, 2, block_size, num_kv_heads, head_dim, device=DEVICE)
    slots = torch.tensor([0, 9, 10, 31, 17], device=DEVICE)
    expected = cache.clone()
    write_kv_reference(expected[:, 1], key, value, slots)
    write_kv_triton(cache[:, 1], key, value, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=str)
def test_write_kv_skips_padded_slots(kv_dtype):
    # A graphed decode pads its batch with PAD_SLOT_ID rows: only the real rows are stored.
    num_kv_heads, head_dim, block_size = 2, 16, 8
    key = torch.randn(4, num_kv_heads, head_dim, device=DEVICE)
    value = torch.randn(4, num_kv_heads, head_dim, device=DEVICE)
    cache = torch.zeros(3, 2, block_size, num_kv_heads, head_dim, device=DEVICE).to(kv_dtype)
    scales = None if kv_dtype == torch.float32 else torch.ones(
        3, 2, block_size, num_kv_heads, device=DEVICE)
    expected, expected_scales = cache.clone(), None if scales is None else scales.clone()
    real = [0, 2]
    slots = torch.tensor([9, PAD_SLOT_ID, 20, PAD_SLOT_ID], device=DEVICE)
    write_kv_reference(expected, key[real], value[real], slots[real], expected_scales)
    write_kv_triton(cache, key, value, slots, scales)
    assert torch.equal(cache, expected)
    assert scales is None or torch.equal(scales, expected_scales)


def test_write_kv_of_no_tokens_changes_nothing():
    cache = torch.randn(2, 2, 8, 1, 16, device=DEVICE)
    before = cache.clone()
    empty = torch.empty(0, 1, 16, device=DEVICE)
    write_kv_triton(cache, empty, empty, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("layer", [None, 1])
def test_copy_blocks_copies_whole_blocks(layer):
    cache = torch.randn(
        6, 3, 2, 8, 2, 16, device=DEVICE
    )  # [blocks, layers, 2, block_size, heads, dim]
    target = cache if layer is None else cache[:, layer]
    expected = cache.clone()
    expected_target = expected if layer is None else expected[:, layer]
    expected_target[[4, 0]] = expected_target[[1, 3]]
    triton_kv.copy_blocks(target, [1, 3], [4, 0])
    assert torch.equal(cache, expected)


def test_copy_blocks_rejects_overlapping_copies():
    cache = torch.randn(4, 1, 2, 8, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="distinct"):
        triton_kv.copy_blocks(cache, [0, 1], [1, 2])
    with pytest.raises(ValueError, match="same length"):
        triton_kv.copy_blocks(cache, [0], [1, 2])
    triton_kv.copy_blocks(cache, [], [])  # nothing to do


# ---------------------------------------------------------------- decode

DECODE_SEQS = [
    (0, 1),  # the very first token: a one-token context
    (6, 1),  # context ends mid-block
    (31, 1),  # ends on a block boundary for block sizes 8, 16 and 32
    (70, 1),  # several tiles
]


def write_new_tokens(batch: Batch) -> None:
    """The new tokens' K/V (codes and scales, if quantized) into the cache, by torch."""
    slots = batch.metadata.slot_mapping
    write_kv_reference(batch.kv_cache_layer, batch.key, batch.value, slots, batch.kv_scales)


def run_decode(batch: Batch, **kwargs) -> torch.Tensor:
    """The decode kernel over a cache that already holds the new tokens' K/V."""
    write_new_tokens(batch)
    metadata = batch.metadata
    return triton_decode.paged_decode(
        batch.query,
        batch.kv_cache_layer,
        metadata.block_tables,
        metadata.seq_lens,
        batch.scale,
        max_seq_len=metadata.max_seq_len,
        kv_scales=batch.kv_scales,
        **kwargs,
    )


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group_size", [1, 4, 8])
def test_decode_equals_reference(block_size, group_size):
    batch = make_batch(DECODE_SEQS, block_size, group_size=group_size)
    expected, _ = reference(batch)
    assert_close(run_decode(batch), expected, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("block_n", [16, 64])
def test_split_decode_equals_reference(num_splits, block_n):
    # With 8 splits a 7-token context leaves most splits empty; the reduction must skip them.
    batch = make_batch([(6, 1), (70, 1), (0, 1), (100, 1)], 16, group_size=4)
    expected, _ = reference(batch)
    config = triton_decode.DecodeConfig(block_n=block_n)
    actual = run_decode(batch, num_splits=num_splits, config=config)
    assert_close(actual, expected, torch.float32)


def test_decode_tiles_smaller_than_blocks():
    batch = make_batch([(40, 1), (77, 1)], 64, group_size=2)
    expected, _ = reference(batch)
    config = triton_decode.DecodeConfig(block_n=16)
    assert_close(run_decode(batch, config=config), expected, torch.float32)


def test_decode_over_shared_prefix_blocks():
    batch = make_batch([(20, 1), (17, 1), (33, 1)], 8, group_size=4, num_shared_blocks=2)
    expected, _ = reference(batch)
    assert_close(run_decode(batch, num_splits=2), expected, torch.float32)


def test_decode_with_head_dim_not_a_power_of_two():
    batch = make_batch([(9, 1), (30, 1)], 8, group_size=3, head_dim=24)
    expected, _ = reference(batch)
    assert_close(run_decode(batch, num_splits=2), expected, torch.float32)


def test_decode_of_no_sequences_returns_empty():
    query = torch.empty(0, 4, 16, device=DEVICE)
    cache = torch.zeros(2, 2, 8, 1, 16, device=DEVICE)
    out = triton_decode.paged_decode(
        query,
        cache,
        torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
        torch.zeros(0, dtype=torch.int32, device=DEVICE),
        1.0,
        max_seq_len=0,
    )
    assert out.shape == (0, 4, 16)


def test_choose_num_splits():
    choose = triton_decode.choose_num_splits
    # 132 SMs (H100/H200), 8 KV heads: batch 1 at 8k splits 32 ways (8192 / 256 tokens).
    assert choose(1, 8, 8192, num_sms=132) == 32
    assert choose(1, 8, 512, num_sms=132) == 2  # short context: at most 512 / 256 splits
    assert choose(16, 8, 8192, num_sms=132) == 3  # ceil(264 / 128)
    assert choose(64, 8, 8192, num_sms=132) == 1  # 512 programs already fill the GPU
    assert choose(1, 1, 10**6, num_sms=132) == 64  # capped at MAX_SPLITS
    assert choose(0, 8, 0, num_sms=132) == 1
    assert choose(1, 8, 8192, num_sms=132, sliding_window=512) == 2  # the window's tokens


def test_configs_reject_bad_tiles():
    with pytest.raises(ValueError, match="block_n"):
        triton_decode.DecodeConfig(block_n=48)
    with pytest.raises(ValueError, match="block_m"):
        triton_prefill.PrefillConfig(block_m=8)


# ---------------------------------------------------------------- prefill / extend

PREFILL_SEQS = [
    (0, 9),  # prefill from scratch, ends mid-block
    (5, 7),  # extend from a cached prefix that ends mid-block
    (16, 16),  # extend from a block-aligned prefix
    (0, 1),  # a one-token prompt
    (40, 1),  # a one-token extend (a chunk boundary)
    (3, 45),  # a long query over several query tiles
]


def run_prefill(batch: Batch, **kwargs) -> torch.Tensor:
    write_new_tokens(batch)
    metadata = batch.metadata
    return triton_prefill.paged_prefill(
        batch.query,
        batch.kv_cache_layer,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
        batch.scale,
        max_query_len=metadata.max_query_len,
        kv_scales=batch.kv_scales,
        **kwargs,
    )


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group_size", [1, 4, 8])
def test_prefill_equals_reference(block_size, group_size):
    batch = make_batch(PREFILL_SEQS, block_size, group_size=group_size)
    expected, _ = reference(batch)
    assert_close(run_prefill(batch), expected, torch.float32)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 64), (64, 16)])
def test_prefill_tile_shapes(block_m, block_n):
    batch = make_batch([(0, 33), (21, 19), (64, 3)], 16, group_size=4)
    expected, _ = reference(batch)
    config = triton_prefill.PrefillConfig(block_m=block_m, block_n=block_n)
    assert_close(run_prefill(batch, config=config), expected, torch.float32)


def test_prefill_from_shared_prefix_blocks():
    # Two requests whose first 3 blocks are one prefix-cache hit, each extending past it.
    batch = make_batch([(24, 10), (27, 5)], 8, group_size=4, num_shared_blocks=3)
    expected, _ = reference(batch)
    assert_close(run_prefill(batch), expected, torch.float32)


def test_prefill_with_odd_group_and_head_dim():
    batch = make_batch([(4, 13), (0, 20)], 8, group_size=3, head_dim=24)
    expected, _ = reference(batch)
    assert_close(run_prefill(batch), expected, torch.float32)


# ---------------------------------------------------------------- the backend


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("group_size", [1, 4, 8])
def test_backend_mixed_batch_equals_torch_backend(block_size, group_size):
    seq_shapes = [(0, 1), (12, 1), (63, 1), (0, 10), (9, 6), (32, 17)]
    batch = make_batch(seq_shapes, block_size, group_size=group_size, seed=block_size)
    expected, expected_cache = reference(batch)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache_layer, batch.metadata, batch.scale
    )
    assert_close(actual, expected, torch.float32)
    assert torch.equal(batch.kv_cache_layer, expected_cache)


@pytest.mark.parametrize("seq_shapes", [[(5, 1), (0, 1)], [(0, 4), (7, 2)]])
def test_backend_all_decode_or_all_prefill(seq_shapes):
    batch = make_batch(seq_shapes, 8, group_size=2)
    expected, _ = reference(batch)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache_layer, batch.metadata, batch.scale
    )
    assert_close(actual, expected, torch.float32)


def test_backend_over_a_layer_of_the_whole_cache():
    # The model passes kv[:, layer], strided across blocks; the other layers stay untouched.
    batch = make_batch([(10, 1), (3, 6)], 8, group_size=4)
    whole = torch.randn(
        batch.kv_cache_layer.shape[0], 3, *batch.kv_cache_layer.shape[1:], device=DEVICE
    )
    whole[:, 1] = batch.kv_cache_layer
    expected_whole = whole.clone()
    expected, expected_whole[:, 1] = reference(batch)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, whole[:, 1], batch.metadata, batch.scale
    )
    assert_close(actual, expected, torch.float32)
    assert torch.equal(whole, expected_whole)


def test_backend_with_an_empty_batch():
    metadata = AttentionMetadata.build([], [], [], [], layout=KVLayout(8))
    cache = torch.randn(2, 2, 8, 1, 16, device=DEVICE)
    empty_q, empty_kv = torch.empty(0, 2, 16, device=DEVICE), torch.empty(0, 1, 16, device=DEVICE)
    out = triton_backend.TritonAttentionBackend().forward(
        empty_q, empty_kv, empty_kv, cache, metadata, 0.25
    )
    assert out.shape == (0, 2, 16)


# ---------------------------------------------------------------- sliding window
# The torch reference is checked against dense windowed attention (test_torch_ref.py); here the
# kernels equal it. Windows: 1, shorter than a tile and mid-block (7), a block (8), across
# blocks and tiles (19), longer than some contexts (40), longer than all (1000: full).

WINDOWS = [1, 7, 8, 19, 40, 1000]
WINDOW_DECODE_SEQS = [(0, 1), (6, 1), (15, 1), (39, 1), (70, 1)]
WINDOW_PREFILL_SEQS = [(0, 30), (9, 7), (24, 16), (50, 1), (3, 45)]


@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_windowed_decode_equals_reference(sliding_window, num_splits):
    # Three splits of a 1-token window leave two empty: the reduction must skip them.
    batch = make_batch(WINDOW_DECODE_SEQS, 8, group_size=4, seed=7)
    expected, _ = reference(batch, sliding_window)
    config = triton_decode.DecodeConfig(block_n=16)
    actual = run_decode(batch, num_splits=num_splits, config=config, sliding_window=sliding_window)
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (64, 16), (64, 64)])
def test_windowed_prefill_equals_reference(sliding_window, block_m, block_n):
    # block_m 16 with 4 heads a KV head: 4 tokens a program, so a long query's programs start
    # their walks at different windows; block_n 16 puts several tiles before a window.
    batch = make_batch(WINDOW_PREFILL_SEQS, 8, group_size=4, seed=8)
    expected, _ = reference(batch, sliding_window)
    config = triton_prefill.PrefillConfig(block_m=block_m, block_n=block_n)
    actual = run_prefill(batch, config=config, sliding_window=sliding_window)
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("sliding_window", [5, 16])
def test_windowed_backend_mixed_batch_equals_torch_backend(sliding_window):
    seq_shapes = [(0, 1), (12, 1), (63, 1), (0, 10), (9, 6), (32, 17)]
    batch = make_batch(seq_shapes, 8, group_size=3, head_dim=24, seed=9)
    expected, expected_cache = reference(batch, sliding_window)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache_layer, batch.metadata, batch.scale,
        sliding_window=sliding_window,
    )
    assert_close(actual, expected, torch.float32)
    assert torch.equal(batch.kv_cache_layer, expected_cache)


def test_windowed_attention_over_a_quantized_cache():
    batch = make_batch([(20, 1), (45, 1), (5, 12), (30, 9)], 8, group_size=2, head_dim=64,
                       kv_dtype=torch.int8, seed=10)
    expected, _, _ = reference_with_scales(batch, 11)
    kv_cache_layer, kv_scales = batch.kv_cache_layer.clone(), batch.kv_scales.clone()
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, kv_cache_layer, batch.metadata, batch.scale,
        kv_scales, sliding_window=11,
    )
    assert_close(actual, expected, torch.float32)


# ---------------------------------------------------------------- soft-capped scores
# The torch reference is checked against dense capped attention (test_torch_ref.py). Queries x3:
# scores with a standard deviation of about 3, so caps of 1 and 4 change most weights.


@pytest.mark.parametrize("logit_softcap", [1.0, 4.0])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_soft_capped_decode_equals_reference(logit_softcap, sliding_window, num_splits):
    batch = make_batch(WINDOW_DECODE_SEQS, 8, group_size=4, seed=11)
    batch.query *= 3
    expected, _ = reference(batch, sliding_window, logit_softcap)
    uncapped, _ = reference(batch, sliding_window)
    assert (expected - uncapped).abs().max() > 0.05  # the cap matters here
    actual = run_decode(batch, num_splits=num_splits, config=triton_decode.DecodeConfig(16),
                        sliding_window=sliding_window, logit_softcap=logit_softcap)
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("logit_softcap", [1.0, 4.0])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_soft_capped_prefill_equals_reference(logit_softcap, sliding_window):
    batch = make_batch(WINDOW_PREFILL_SEQS, 8, group_size=4, seed=12)
    batch.query *= 3
    expected, _ = reference(batch, sliding_window, logit_softcap)
    config = triton_prefill.PrefillConfig(block_m=16, block_n=16)
    actual = run_prefill(batch, config=config, sliding_window=sliding_window,
                         logit_softcap=logit_softcap)
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_soft_capped_backend_mixed_batch_equals_torch_backend(kv_dtype):
    seq_shapes = [(0, 1), (12, 1), (63, 1), (0, 10), (9, 6), (32, 17)]
    batch = make_batch(seq_shapes, 8, group_size=3, head_dim=24, seed=13, kv_dtype=kv_dtype)
    batch.query *= 3
    expected, _, _ = reference_with_scales(batch, 5, 2.0)
    kv_scales = None if batch.kv_scales is None else batch.kv_scales.clone()
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache_layer.clone(), batch.metadata,
        batch.scale, kv_scales, sliding_window=5, logit_softcap=2.0,
    )
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_windowed_attention_never_reads_the_blocks_before_the_window(num_splits, monkeypatch):
    # NaN in every block wholly before the tile (16 tokens) holding a sequence's first window
    # start: one load would poison the output.
    block_size, block_n, sliding_window = 8, 16, 10
    seq_shapes = [(40, 1), (70, 1), (33, 12), (60, 20)]
    batch = make_batch(seq_shapes, block_size, group_size=2, seed=12)
    expected, _ = reference(batch, sliding_window)
    tables = batch.metadata.block_tables
    for row, (cached, _) in enumerate(seq_shapes):
        first_tile = max(0, cached + 1 - sliding_window) // block_n * block_n
        batch.kv_cache_layer[tables[row, : first_tile // block_size].long()] = float("nan")
    monkeypatch.setattr(triton_decode, "choose_num_splits", lambda *args: num_splits)
    backend = triton_backend.TritonAttentionBackend(
        triton_decode.DecodeConfig(block_n=block_n),
        triton_prefill.PrefillConfig(block_m=16, block_n=block_n),
    )
    actual = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache_layer,
                             batch.metadata, batch.scale, sliding_window=sliding_window)
    assert_close(actual, expected, torch.float32)


def test_the_split_count_follows_the_window_not_the_context(monkeypatch):
    # On 132 multiprocessors an 8k context would split 32 ways; its 300-token window, once.
    planned = []
    choose = triton_decode.choose_num_splits
    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)
    monkeypatch.setattr(triton_decode, "choose_num_splits",
                        lambda *args: planned.append(choose(*args)) or planned[-1])
    batch = make_batch([(8191, 1)], 64, num_kv_heads=8, head_dim=16, seed=11)
    expected, _ = reference(batch, 300)
    assert_close(run_decode(batch, sliding_window=300), expected, torch.float32)
    assert planned == [1]


# ---------------------------------------------------------------- quantized KV (int8 / fp8)
# The write is exact: codes and scales equal torch's bit for bit (IEEE divisions, integer
# rounding to fp8). Attention dequantizes each tile in registers to the very values the
# reference's gathered copy holds, so outputs agree to the float tolerances above.

QUANT_DECODE_SHAPES = [(64, 16, 4), (128, 1, 2), (128, 8, 8)]  # (head_dim, block_size, group)
QUANT_PREFILL_SHAPES = [(64, 8, 4), (128, 1, 2), (128, 16, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=kv_id)
def test_quantized_write_kv_equals_torch(kv_dtype, dtype):
    batch = make_batch(
        [(3, 1), (0, 11), (16, 5)], 16, num_kv_heads=3, head_dim=64, dtype=dtype, kv_dtype=kv_dtype
    )
    batch.value[2, 1] = 0  # an all-zero row: scale 1, codes 0
    expected, expected_scales = batch.kv_cache_layer.clone(), batch.kv_scales.clone()
    slots = batch.metadata.slot_mapping
    write_kv_reference(expected, batch.key, batch.value, slots, expected_scales)
    write_kv_triton(batch.kv_cache_layer, batch.key, batch.value, slots, batch.kv_scales)
    assert_bits_equal(batch.kv_cache_layer, expected)
    assert torch.equal(batch.kv_scales, expected_scales)


def rounding_cases(kv_dtype: torch.dtype) -> torch.Tensor:
    """Values for codes of scale 1: every finite code, every tie between neighbouring codes
    (subnormal ones included), values just either side of each tie, signed zeros, tiny ones."""
    largest = QUANTIZED_CODE_MAX[str(kv_dtype).removeprefix("torch.")]
    if kv_dtype == torch.int8:
        return torch.arange(-4 * 127, 4 * 127 + 1) / 4  # quarter steps: ties at .5
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype).float()
    codes = codes[torch.isfinite(codes)].unique()
    ties = (codes[1:] + codes[:-1]) / 2
    near = torch.cat([ties * (1 + 2**-20), ties * (1 - 2**-20)])
    values = torch.cat([codes, ties, near, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    return values[values.abs() <= largest]


@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=kv_id)
def test_quantized_write_rounds_like_torch(kv_dtype):
    # Each row leads with ±qmax, so its scale is exactly 1 and its codes are the values rounded.
    largest = QUANTIZED_CODE_MAX[str(kv_dtype).removeprefix("torch.")]
    values = rounding_cases(kv_dtype)
    num_rows = -(-values.numel() // 63)
    values = torch.cat([values, torch.zeros(num_rows * 63 - values.numel())]).view(num_rows, 1, 63)
    rows = torch.cat([torch.full((num_rows, 1, 1), largest), values], dim=2).to(DEVICE)
    block_size = 16
    num_blocks = -(-num_rows // block_size)
    cache = torch.zeros(num_blocks, 2, block_size, 1, 64, device=DEVICE).to(kv_dtype)
    scales = torch.zeros(num_blocks, 2, block_size, 1, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:num_rows].to(DEVICE)
    expected, expected_scales = cache.clone(), scales.clone()
    write_kv_reference(expected, rows, -rows, slots, expected_scales)
    write_kv_triton(cache, rows, -rows, slots, scales)
    assert_bits_equal(cache, expected)
    assert torch.equal(scales, expected_scales)
    assert bool((expected_scales[slots // block_size, :, slots % block_size] == 1).all())


@pytest.mark.parametrize(("head_dim", "block_size", "group_size"), QUANT_DECODE_SHAPES)
@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=kv_id)
def test_quantized_decode_equals_reference(kv_dtype, head_dim, block_size, group_size):
    batch = make_batch(
        DECODE_SEQS, block_size, group_size=group_size, head_dim=head_dim, kv_dtype=kv_dtype
    )
    expected, _ = reference(batch)
    assert_close(run_decode(batch), expected, torch.float32)
    # Three splits: the one-token context leaves two of them empty.
    config = triton_decode.DecodeConfig(block_n=16)
    assert_close(run_decode(batch, num_splits=3, config=config), expected, torch.float32)


@pytest.mark.parametrize(("head_dim", "block_size", "group_size"), QUANT_PREFILL_SHAPES)
@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=kv_id)
def test_quantized_prefill_equals_reference(kv_dtype, head_dim, block_size, group_size):
    # PREFILL_SEQS: prompts from scratch and extends of cached prefixes, ragged.
    batch = make_batch(
        PREFILL_SEQS, block_size, group_size=group_size, head_dim=head_dim, kv_dtype=kv_dtype
    )
    expected, _ = reference(batch)
    assert_close(run_prefill(batch), expected, torch.float32)


@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=kv_id)
def test_quantized_backend_over_a_layer_of_the_whole_cache(kv_dtype):
    # Decodes, prompts and extends in one step, through layer 1 of a 3-layer cache and of its
    # scale pool (both strided across blocks); the other layers stay untouched.
    seq_shapes = [(0, 1), (12, 1), (40, 1), (0, 10), (9, 6), (16, 17)]
    batch = make_batch(seq_shapes, 8, group_size=4, head_dim=64, kv_dtype=kv_dtype, seed=2)
    layer = batch.kv_cache_layer
    whole = torch.randn(layer.shape[0], 3, *layer.shape[1:], device=DEVICE).to(kv_dtype)
    whole_scales = torch.rand(layer.shape[0], 3, *layer.shape[1:4], device=DEVICE)
    whole[:, 1], whole_scales[:, 1] = layer, batch.kv_scales
    expected_whole, expected_whole_scales = whole.clone(), whole_scales.clone()
    expected, expected_whole[:, 1], expected_whole_scales[:, 1] = reference_with_scales(batch)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, whole[:, 1], batch.metadata, batch.scale,
        whole_scales[:, 1],
    )  # fmt: skip
    assert_close(actual, expected, torch.float32)
    assert_bits_equal(whole, expected_whole)
    assert torch.equal(whole_scales, expected_whole_scales)


def test_quantized_cache_needs_its_scales():
    batch = make_batch([(5, 1)], 8, kv_dtype=torch.int8)
    metadata, slots = batch.metadata, batch.metadata.slot_mapping
    with pytest.raises(AssertionError, match="needs kv_scales"):
        write_kv_triton(batch.kv_cache_layer, batch.key, batch.value, slots)
    with pytest.raises(AssertionError, match="needs kv_scales"):
        triton_decode.paged_decode(
            batch.query, batch.kv_cache_layer, metadata.block_tables, metadata.seq_lens, 1.0, 6
        )
    float_cache = batch.kv_cache_layer.float()
    with pytest.raises(AssertionError, match="has no scales"):
        triton_prefill.paged_prefill(
            batch.query, float_cache, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_tables, 1.0, 1, kv_scales=batch.kv_scales,
        )  # fmt: skip


# ---------------------------------------------------------------- compiled for a real GPU

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPILE_SCRIPT = """
import dataclasses, json, sys
from tests.attention.triton_compile import compile_all
builds = compile_all(*json.loads(sys.argv[1]))
print(json.dumps([dataclasses.asdict(build) for build in builds]))
"""


@pytest.mark.parametrize(
    ("dtype", "head_dim", "group_size", "block_size", "kv_dtypes"),
    [
        ("bfloat16", 128, 4, 16, ["int8", "float8_e4m3fn", "float8_e5m2"]),
        ("float16", 64, 8, 32, ["int8", "float8_e4m3fn"]),
    ],
)
def test_kernels_compile_for_sm90_without_spills(
    dtype, head_dim, group_size, block_size, kv_dtypes
):
    # A fresh process: this one imported triton in interpreter mode. It runs from the
    # repository root, so `tests.attention.triton_compile` imports. Quantized KV adds variants
    # of the kernels that touch codes (decode, its split form, prefill, the write).
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    args = json.dumps([dtype, head_dim, group_size, block_size, 90, kv_dtypes])
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    builds = {build["name"]: build for build in json.loads(result.stdout.splitlines()[-1])}
    suffixes = [""] + ["_" + KV_DTYPE_IDS[getattr(torch, name)] for name in kv_dtypes]
    reading = [f"{kernel}{suffix}" for suffix in suffixes for kernel in ("decode", "decode_split")]
    reading += [f"prefill{suffix}" for suffix in suffixes]
    reading += ["decode_softcap", "decode_split_softcap", "prefill_softcap"]
    writing = [f"write_kv{suffix}" for suffix in suffixes]
    assert set(builds) == {*reading, *writing, "decode_reduce", "copy_blocks"}
    for build in builds.values():
        assert build["local_bytes"] == 0, build  # no register spills
        assert build["shared_bytes"] <= 227 * 1024, build  # sm_90's limit per program
    for name in reading:
        assert builds[name]["has_async_copies"], builds[name]  # K/V gathers are 16-byte copies


# ---------------------------------------------------------------- GPU: realistic shapes

NO_CUDA = "needs a CUDA device"


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(IS_INTERPRETED, reason=NO_CUDA)(test))


GPU_DTYPES = [torch.float16, torch.bfloat16]
GPU_BLOCK_SIZES = [8, 16, 32, 64, 128]


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", GPU_BLOCK_SIZES)
def test_gpu_decode_realistic(dtype, head_dim, block_size):
    lengths = [1, 17, 300, 1000, 2049, 4000, 513, 64]
    batch = make_batch([(n - 1, 1) for n in lengths], block_size, 8, 4, head_dim, dtype, seed=3)
    expected, _ = reference(batch)
    assert_close(run_decode(batch), expected, dtype)


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_splits", [None, 7, 32])
def test_gpu_split_decode_long_context(dtype, num_splits):
    batch = make_batch([(8191, 1), (5000, 1)], 16, 8, 4, 128, dtype, seed=4)
    expected, _ = reference(batch)
    assert_close(run_decode(batch, num_splits=num_splits), expected, dtype)


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", GPU_BLOCK_SIZES)
def test_gpu_prefill_realistic(dtype, head_dim, block_size):
    seq_shapes = [(0, 700), (256, 300), (1000, 1), (37, 129), (0, 2)]
    batch = make_batch(seq_shapes, block_size, 8, 4, head_dim, dtype, seed=5)
    expected, _ = reference(batch)
    assert_close(run_prefill(batch), expected, dtype)


@gpu
@pytest.mark.parametrize("dtype", [*GPU_DTYPES, torch.float32])
@pytest.mark.parametrize("group_size", [1, 4, 8])
def test_gpu_backend_mixed_batch(dtype, group_size):
    seq_shapes = [(100, 1), (2000, 1), (0, 1), (0, 333), (480, 64), (16, 1000)]
    batch = make_batch(seq_shapes, 16, 4, group_size, 128, dtype, seed=6)
    expected, expected_cache = reference(batch)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache_layer, batch.metadata, batch.scale
    )
    assert_close(actual, expected, dtype)
    assert torch.equal(batch.kv_cache_layer, expected_cache)


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("sliding_window", [512, 1000, 4096])
def test_gpu_windowed_backend_realistic(dtype, sliding_window):
    # Gemma 3's and Mistral's windows over long decodes (split) and prompts longer than them.
    seq_shapes = [(8191, 1), (5000, 1), (300, 1), (0, 1500), (3000, 700), (40, 9)]
    batch = make_batch(seq_shapes, 16, 4, 2, 128, dtype, seed=7)
    expected, expected_cache = reference(batch, sliding_window)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache_layer, batch.metadata, batch.scale,
        sliding_window=sliding_window,
    )
    assert_close(actual, expected, dtype)
    assert torch.equal(batch.kv_cache_layer, expected_cache)


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("sliding_window", [None, 4096])
def test_gpu_soft_capped_backend_realistic(dtype, sliding_window):
    # Gemma 2's shapes (head_dim 256, GQA 2, window 4096 on every other layer) with a cap of 5
    # over scores of standard deviation ~3 (Gemma 2 caps at 50: far fewer scores reach it).
    seq_shapes = [(8191, 1), (5000, 1), (300, 1), (0, 1500), (3000, 700), (40, 9)]
    batch = make_batch(seq_shapes, 16, 4, 2, 256, dtype, seed=14)
    batch.query *= 3
    expected, expected_cache = reference(batch, sliding_window, 5.0)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache_layer, batch.metadata, batch.scale,
        sliding_window=sliding_window, logit_softcap=5.0,
    )
    assert_close(actual, expected, dtype)
    assert torch.equal(batch.kv_cache_layer, expected_cache)


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=kv_id)
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 32)])
def test_gpu_quantized_backend_realistic(dtype, kv_dtype, head_dim, block_size):
    # Long decodes (split), prompts and long extends over int8 / fp8 codes; the write's codes
    # and scales equal torch's bit for bit.
    seq_shapes = [(4000, 1), (100, 1), (0, 1), (0, 700), (1000, 300), (37, 129)]
    batch = make_batch(seq_shapes, block_size, 8, 4, head_dim, dtype, seed=7, kv_dtype=kv_dtype)
    expected, expected_cache, expected_scales = reference_with_scales(batch)
    actual = triton_backend.TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache_layer, batch.metadata, batch.scale,
        batch.kv_scales,
    )  # fmt: skip
    assert_close(actual, expected, dtype)
    assert_bits_equal(batch.kv_cache_layer, expected_cache)
    assert torch.equal(batch.kv_scales, expected_scales)


@gpu
def test_gpu_copy_blocks_of_a_large_cache():
    cache = torch.randn(64, 32, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    expected = cache.clone()
    expected[[5, 9, 40]] = expected[[1, 2, 3]]
    triton_kv.copy_blocks(cache, [1, 2, 3], [5, 9, 40])
    assert torch.equal(cache, expected)


def greedy_tokens(
    backend: str, preset: str, dtype: str, kv_cache_dtype: str = "auto"
) -> list[list[int]]:
    """Greedy continuations of prompts that share a prefix (prefix caching); a small token
    budget per step mixes chunked prefills with decodes."""
    from kvpool import LLM, SamplingParams

    shared = [(7 * i) % 500 + 1 for i in range(40)]
    prompts = [
        {"prompt_token_ids": [*shared, 11, 12, 13]},
        {"prompt_token_ids": [*shared, 21]},
        {"prompt_token_ids": [5, 6, 7]},
        {"prompt_token_ids": [(13 * i) % 500 + 1 for i in range(150)]},
    ]
    llm = LLM(
        model=preset,
        load_format="dummy",
        dtype=dtype,
        device=DEVICE,
        attention_backend=backend,
        kv_cache_memory=1 << 28,
        max_num_batched_tokens=64,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert llm.engine.runner.model.attention_backend.name == backend
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_greedy_generation_equals_torch_backend():
    # The tiny preset (2 layers, head_dim 16): fast enough for the interpreter.
    expected = greedy_tokens("torch", "tiny", "float32")
    assert greedy_tokens("triton", "tiny", "float32") == expected
    assert all(len(ids) == 12 for ids in expected)


def test_greedy_generation_over_int8_kv_equals_torch_backend():
    # The scales reach every layer's three launches; the kernel tests above cover fp8 too.
    expected = greedy_tokens("torch", "tiny", "float32", kv_cache_dtype="int8")
    assert greedy_tokens("triton", "tiny", "float32", kv_cache_dtype="int8") == expected


@gpu
def test_gpu_greedy_generation_equals_torch_backend():
    # Dummy SmolLM2-shaped weights (GQA 9:3, head_dim 64) in fp32, so tokens agree exactly.
    expected = greedy_tokens("torch", "smollm2-135m", "float32")
    assert greedy_tokens("triton", "smollm2-135m", "float32") == expected
