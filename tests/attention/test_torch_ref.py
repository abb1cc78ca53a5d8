"""The torch and cpu paged-attention backends equal dense causal attention on random inputs.

The cpu backend is the torch one with decode attention in a C++ kernel (float32 on the CPU;
other dtypes take the torch path), so both run every case here.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.attention.cpu_backend import CpuAttentionBackend
from kvpool.attention.kv_write import write_kv_reference
from kvpool.attention.metadata import AttentionMetadata
from kvpool.attention.torch_ref import TorchAttentionBackend, plan_decode_groups
from kvpool.memory.kv_layout import KVLayout

HEAD_DIM = 16
NUM_KV_HEADS = 2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}


def dense_attention(query, keys, values, scale, sliding_window=None, logit_softcap=None):
    """Causal attention of the last `len(query)` positions over a full context (GQA by repeat);
    with `sliding_window` W, position p sees keys k with p - W < k <= p (transformers' mask);
    with `logit_softcap` c, each score s is c * tanh(s / c) (transformers' Gemma 2).

    query [query_len, H, D], keys/values [seq_len, Hkv, D] -> [query_len, H, D]
    """
    query_len, seq_len = query.shape[0], keys.shape[0]
    group_size = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group_size, dim=1)
    values = values.float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    is_visible = visible_keys(torch.arange(seq_len - query_len, seq_len), seq_len, sliding_window)
    scores = scores.masked_fill(~is_visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def visible_keys(query_positions, seq_len, sliding_window=None):
    """[len(query_positions), seq_len] bool: which keys each query position attends to."""
    query_positions, key_positions = query_positions[:, None], torch.arange(seq_len)[None, :]
    is_visible = key_positions <= query_positions
    if sliding_window is not None:
        is_visible &= key_positions > query_positions - sliding_window
    return is_visible


@pytest.mark.parametrize("sliding_window", [1, 3, 8])
def test_the_window_is_the_one_transformers_applies(sliding_window):
    # The lead's model tests compare tokens with transformers (Mistral, Gemma 2 / 3), so the
    # reference's window must be transformers' mask exactly, not off by one.
    masking_utils = pytest.importorskip("transformers.masking_utils")
    mask_function = masking_utils.sliding_window_causal_mask_function(sliding_window)
    positions = torch.arange(12)
    expected = mask_function(0, 0, positions[:, None], positions[None, :])
    assert torch.equal(visible_keys(positions, 12, sliding_window), expected)


def run_case(seq_shapes, block_size, group_size, dtype, seed=0, backend="torch",
             sliding_window=None, logit_softcap=None):
    """seq_shapes: (num_cached_tokens, query_len) per sequence, decodes first."""
    generator = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group_size
    blocks_needed = sum(-(-(cached + new) // block_size) for cached, new in seq_shapes)
    num_blocks = blocks_needed + 3
    block_ids = list(range(num_blocks))
    random.Random(seed).shuffle(block_ids)  # physical order unrelated to logical order
    kv_layer = torch.zeros(num_blocks, 2, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    tables, queries, new_keys, new_values, expected, slots = [], [], [], [], [], []
    scale = HEAD_DIM**-0.5
    for cached, new in seq_shapes:
        seq_len = cached + new
        table = [block_ids.pop() for _ in range(-(-seq_len // block_size))]
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        shape = (seq_len, NUM_KV_HEADS, HEAD_DIM)
        keys = torch.randn(shape, generator=generator).to(dtype)
        values = torch.randn(shape, generator=generator).to(dtype)
        query = torch.randn(new, num_heads, HEAD_DIM, generator=generator).to(dtype)
        write_kv_reference(
            kv_layer,
            keys[:cached],
            values[:cached],
            torch.tensor(seq_slots[:cached], dtype=torch.int64),
        )
        tables.append(table)
        queries.append(query)
        new_keys.append(keys[cached:])
        new_values.append(values[cached:])
        slots.extend(seq_slots[cached:])
        expected.append(dense_attention(query, keys, values, scale, sliding_window,
                                        logit_softcap))
    metadata = AttentionMetadata.build(
        query_lens=[new for _, new in seq_shapes],
        seq_lens=[cached + new for cached, new in seq_shapes],
        block_tables=tables,
        slot_mapping=slots,
        layout=KVLayout(block_size),
    )
    out = BACKENDS[backend]().forward(
        torch.cat(queries), torch.cat(new_keys), torch.cat(new_values), kv_layer, metadata, scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )
    return out.float(), torch.cat(expected)


MIXED_BATCH = [
    (0, 1),  # decode of the very first token
    (6, 1),  # decode, context ends mid-block
    (31, 1),  # decode at a block boundary for block_size 32
    (0, 9),  # prefill from scratch
    (5, 7),  # extend from a cached prefix that ends mid-block
    (16, 16),  # extend from a block-aligned prefix
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("block_size", "group_size", "dtype"),
    list(itertools.product([1, 8, 16, 32], [1, 3], [torch.float32, torch.bfloat16])),
)
def test_paged_equals_dense_for_mixed_batches(block_size, group_size, dtype, backend):
    out, expected = run_case(MIXED_BATCH, block_size, group_size, dtype, backend=backend)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", [[(0, 1)], [(40, 1), (3, 1)], [(0, 20)], [(13, 2), (1, 5)]])
def test_decode_only_and_prefill_only_batches(shapes, backend):
    out, expected = run_case(
        shapes, block_size=8, group_size=3, dtype=torch.float32, seed=1, backend=backend
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# (num_cached_tokens, query_len) per sequence, decodes first, for windows of 1..40 tokens over
# blocks of 8: contexts shorter than, equal to and longer than the window, windows that start
# mid-block and on a block boundary, chunks whose cached prefix is partly outside the window.
WINDOW_BATCH = [
    (0, 1),  # a one-token context
    (6, 1),  # a short decode
    (15, 1),  # decode at a block boundary: context 16
    (39, 1),  # decode, context 40
    (70, 1),  # decode, context 71 (ends mid-block)
    (0, 30),  # a prompt longer than the small windows
    (9, 7),  # a chunk after a prefix that ends mid-block
    (24, 16),  # a chunk after a block-aligned prefix
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window", [1, 3, 8, 16, 17, 40, 1000])
@pytest.mark.parametrize(("group_size", "dtype"), [(1, torch.float32), (3, torch.float32),
                                                   (3, torch.bfloat16)])
def test_sliding_window_equals_dense_windowed_attention(sliding_window, group_size, dtype,
                                                        backend):
    out, expected = run_case(WINDOW_BATCH, 8, group_size, dtype, seed=3, backend=backend,
                             sliding_window=sliding_window)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_sliding_window_for_every_block_size(block_size, backend):
    # The window (12) starts mid-block, on a block boundary or inside the first block.
    out, expected = run_case(WINDOW_BATCH, block_size, 2, torch.float32, seed=4,
                             backend=backend, sliding_window=12)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_as_long_as_the_context_is_full_attention(backend):
    shapes = [(30, 1), (0, 12), (20, 11)]  # every context is 31 tokens or fewer
    for sliding_window in (31, 64):
        windowed, _ = run_case(shapes, 8, 3, torch.float32, seed=5, backend=backend,
                               sliding_window=sliding_window)
        full, _ = run_case(shapes, 8, 3, torch.float32, seed=5, backend=backend)
        assert torch.equal(windowed, full)


@st.composite
def windowed_steps(draw):
    """A step's (num_cached_tokens, query_len) per sequence, decodes first, a block size, a
    GQA ratio and a window (None: full)."""
    num_decodes, num_prefills = draw(st.integers(0, 3)), draw(st.integers(0, 2))
    decodes = [(draw(st.integers(0, 60)), 1) for _ in range(num_decodes)]
    prefills = [(draw(st.integers(0, 30)), draw(st.integers(2, 20))) for _ in range(num_prefills)]
    window = draw(st.none() | st.integers(1, 70))
    return decodes + prefills or [(0, 1)], draw(st.sampled_from([1, 4, 8, 16])), \
        draw(st.integers(1, 3)), window


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None, database=None)
@given(step=windowed_steps())
def test_any_windowed_step_equals_dense_attention(backend, step):
    seq_shapes, block_size, group_size, sliding_window = step
    out, expected = run_case(seq_shapes, block_size, group_size, torch.float32, seed=6,
                             backend=backend, sliding_window=sliding_window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window", [None, 3, 16])
@pytest.mark.parametrize("logit_softcap", [1.0, 2.5])
@pytest.mark.parametrize(("group_size", "dtype"), [(1, torch.float32), (3, torch.float32),
                                                   (3, torch.bfloat16)])
def test_soft_capped_scores_equal_dense_capped_attention(logit_softcap, sliding_window,
                                                         group_size, dtype, backend):
    # Scores here have a standard deviation of about 1 (HEAD_DIM ** -0.5 scaling of unit
    # normals): caps of 1 and 2.5 change most rows' weights.
    out, expected = run_case(WINDOW_BATCH, 8, group_size, dtype, backend=backend,
                             sliding_window=sliding_window, logit_softcap=logit_softcap)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    uncapped, _ = run_case(WINDOW_BATCH, 8, group_size, dtype, backend=backend,
                           sliding_window=sliding_window)
    assert (out - uncapped).abs().max() > 0.05  # the cap mattered


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_soft_cap_must_be_positive(backend):
    metadata = AttentionMetadata.build([1], [1], [[0]], [0], KVLayout(4))
    query = torch.zeros(1, 2, HEAD_DIM)
    key = torch.zeros(1, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="logit_softcap"):
        BACKENDS[backend]().forward(query, key, key, torch.zeros(2, 2, 4, NUM_KV_HEADS, HEAD_DIM),
                                    metadata, 1.0, logit_softcap=0.0)


def test_decodes_plan_a_group_per_window_gathering_only_the_window():
    metadata = AttentionMetadata.build(
        query_lens=[1, 1], seq_lens=[40, 5], block_tables=[[7, 3, 9, 4, 2], [6]],
        slot_mapping=[0, 0], layout=KVLayout(8),
    )
    # Full contexts of 40 and 5 tokens pad too much to share a group; windowed, row 0 gathers
    # 16 tokens (positions 30..39 are in blocks 3 and 4 of its table), row 1 its 5, and they do.
    assert [group.rows.tolist() for group in plan_decode_groups(metadata)] == [[0], [1]]
    (windowed,) = plan_decode_groups(metadata, sliding_window=10)
    assert windowed.block_tables.tolist() == [[4, 2], [6, 0]]
    assert windowed.is_valid[:, 0, 0].nonzero().tolist() == (
        [[0, column] for column in range(6, 16)] + [[1, column] for column in range(5)]
    )
    with pytest.raises(ValueError, match="sliding_window"):
        TorchAttentionBackend().forward(*([torch.zeros(1, 1, 8)] * 3), torch.zeros(1, 2, 8, 1, 8),
                                        metadata, 1.0, sliding_window=0)


def test_metadata_counts_leading_decodes():
    metadata = AttentionMetadata.build(
        query_lens=[1, 1, 4, 1],
        seq_lens=[3, 9, 4, 2],
        block_tables=[[0], [1, 2], [3], [4]],
        slot_mapping=[2, 12, 24, 25, 26, 27, 33],
        layout=KVLayout(8),
    )
    assert metadata.num_decode_seqs == 2
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 6, 7]
    assert metadata.block_tables.tolist() == [[0, 0], [1, 2], [3, 0], [4, 0]]
    assert (metadata.max_query_len, metadata.max_seq_len) == (4, 9)
    # The host side of the step's plan, computed once for every layer.
    assert metadata.query_start_loc_cpu == (0, 1, 2, 6, 7)
    assert (metadata.max_decode_seq_len, metadata.max_prefill_query_len) == (9, 4)


def test_metadata_rejects_inconsistent_input():
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        AttentionMetadata.build([3], [2], [[0]], [0, 1, 2], layout=KVLayout(4))
    with pytest.raises(ValueError, match="one slot per new token"):
        AttentionMetadata.build([2], [2], [[0]], [0], layout=KVLayout(4))


def test_decodes_of_very_different_lengths_are_grouped_and_still_exact():
    shapes = [(199, 1), (0, 1), (4, 1), (99, 1), (150, 1), (2, 1), (60, 1)]
    out, expected = run_case(shapes, block_size=8, group_size=3, dtype=torch.float32, seed=2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    metadata = AttentionMetadata.build(
        query_lens=[1] * len(shapes),
        seq_lens=[cached + 1 for cached, _ in shapes],
        block_tables=[list(range(-(-(cached + 1) // 8))) for cached, _ in shapes],
        slot_mapping=[0] * len(shapes),
        layout=KVLayout(8),
    )
    groups = plan_decode_groups(metadata)
    assert len(groups) > 1
    assert sorted(row for group in groups for row in group.rows.tolist()) == list(range(7))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_model_step_reads_nothing_back_to_the_host(backend):
    # On a GPU each read back waits for the queued kernels: one per layer would serialise the
    # step. The backend plans from the metadata's host copies, once per step.
    from kvpool.engine.model_runner import ModelRunner, SequenceChunk
    from kvpool.memory.kv_cache import KVCache
    from kvpool.model.loaders.auto import load_model
    from tests.host_reads import HostReads

    loaded = load_model("tiny", "dummy", attention_backend=BACKENDS[backend]())
    config = loaded.config
    runner = ModelRunner(loaded.model, KVCache(
        KVLayout(4, config.num_layers, config.num_kv_heads, config.head_dim), 16))
    # Two decodes of different lengths beside a prefill chunk after a cached prefix.
    chunks = [SequenceChunk([5], 9, [1, 2, 3]), SequenceChunk([7], 2, [4]),
              SequenceChunk([1, 2, 3], 4, [5, 6])]
    with HostReads() as reads:
        logits = runner.execute(chunks)
    assert reads.total == 0, reads.counts
    assert logits.sampling.shape == (3, config.vocab_size)
