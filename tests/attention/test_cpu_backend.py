"""The C++ paged decode kernel (`kvpool_cpu::paged_decode`) and how it is built and chosen."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from kvpool.attention import cpu_backend, selector
from kvpool.attention.cpu_backend import CpuAttentionBackend, paged_decode
from kvpool.attention.metadata import AttentionMetadata
from kvpool.attention.torch_ref import TorchAttentionBackend, gather_context
from kvpool.kernels import cpu_kernels
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_quant import quantize

CODE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def make_decode_batch(seq_lens, block_size, num_kv_heads, group_size, head_dim, seed=0):
    """A two-layer cache with the sequences' K/V in shuffled blocks of layer 1, plus queries.

    Returns (query, layer view, block_tables, seq_lens tensor, per-sequence dense K/V).
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    block_ids = list(range(num_blocks))
    random.Random(seed).shuffle(block_ids)
    cache = torch.randn(
        num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=generator
    )  # [blocks, layers, K/V, block_size, Hkv, D]: layer 1's view is strided across blocks
    layer = cache[:, 1]
    tables = [[block_ids.pop() for _ in range(count)] for count in blocks_per_seq]
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    contexts = []
    for table, length in zip(tables, seq_lens, strict=True):
        keys = layer[table, 0].reshape(-1, num_kv_heads, head_dim)[:length]
        values = layer[table, 1].reshape(-1, num_kv_heads, head_dim)[:length]
        contexts.append((keys, values))
    num_heads = num_kv_heads * group_size
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator)
    return query, layer, block_tables, torch.tensor(seq_lens, dtype=torch.int32), contexts


def dense_decode(query, contexts, scale, logit_softcap=None):
    outputs = []
    for row, (keys, values) in zip(query, contexts, strict=True):
        group_size = row.shape[0] // keys.shape[1]
        keys = keys.repeat_interleave(group_size, dim=1)  # [context, H, D]
        values = values.repeat_interleave(group_size, dim=1)
        scores = torch.einsum("hd,khd->hk", row, keys) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        weights = scores.softmax(-1)
        outputs.append(torch.einsum("hk,khd->hd", weights, values))
    return torch.stack(outputs)


@pytest.mark.parametrize(
    ("head_dim", "group_size", "block_size"),
    [(64, 3, 16), (128, 4, 16), (64, 1, 5), (40, 2, 8), (128, 8, 1)],  # 40: the generic path
)
def test_paged_decode_equals_dense_attention(head_dim, group_size, block_size):
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 97, 300]
    query, layer, tables, lens, contexts = make_decode_batch(
        seq_lens, block_size, num_kv_heads=2, group_size=group_size, head_dim=head_dim
    )
    scale = head_dim**-0.5
    out = paged_decode(query, layer, tables, lens, scale)
    torch.testing.assert_close(out, dense_decode(query, contexts, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (40, 5)])
def test_a_16_bit_cache_is_read_in_place_with_float32_arithmetic(
    cache_dtype, query_dtype, head_dim, block_size
):
    seq_lens = [1, block_size + 1, 97, 300]
    query, layer, tables, lens, contexts = make_decode_batch(
        seq_lens, block_size, num_kv_heads=3, group_size=3, head_dim=head_dim, seed=5
    )
    query, layer = query.to(query_dtype), layer.to(cache_dtype)  # what the kernel reads
    contexts = [(k.to(cache_dtype).float(), v.to(cache_dtype).float()) for k, v in contexts]
    scale = head_dim**-0.5
    out = paged_decode(query, layer, tables, lens, scale)
    assert out.dtype == query_dtype
    # The reference widens the same 16-bit values and computes in float32: only the final
    # narrowing to the query's dtype rounds.
    expected = dense_decode(query.float(), contexts, scale).to(query_dtype)
    tolerance = 1e-5 if query_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def make_quantized_batch(seq_lens, block_size, num_kv_heads, group_size, head_dim, code_dtype,
                         seed=0):
    """`make_decode_batch` with the cache quantized (`kv_quant.quantize`, the reference) into a
    two-layer code tensor and scale pool. Rows span a wide range of magnitudes, so the scales
    differ from row to row, and a quarter of the elements are much smaller than their row's
    largest, so the float8 codes include subnormals.

    Returns (query, code layer view, scale layer view, block_tables, seq_lens tensor), both
    views strided across blocks as a KVCache's are.
    """
    query, layer, tables, lens, _ = make_decode_batch(
        seq_lens, block_size, num_kv_heads, group_size, head_dim, seed=seed
    )
    generator = torch.Generator().manual_seed(seed + 1)
    cache = torch.stack([torch.randn(layer.shape, generator=generator), layer], dim=1)
    row_size = torch.exp(torch.empty(cache.shape[:-1]).uniform_(-1, 1, generator=generator))
    element_size = torch.exp(torch.empty(cache.shape).uniform_(-12, 0, generator=generator))
    element_size[torch.rand(cache.shape, generator=generator) < 0.75] = 1  # a quarter is small
    codes, scales = quantize(cache * row_size[..., None] * element_size, code_dtype)
    return query, codes[:, 1], scales[:, 1], tables, lens


def reference_decode(query, codes, scales, tables, lens, scale):
    """The torch reference's dequantizing gather (float32), then dense attention."""
    keys, values = gather_context(codes, tables, kv_scales=scales, dtype=torch.float32)
    contexts = [(keys[i, :, :length].transpose(0, 1), values[i, :, :length].transpose(0, 1))
                for i, length in enumerate(lens.tolist())]
    return dense_decode(query.float(), contexts, scale)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "group_size", "block_size"),
    [(64, 1, 16), (128, 3, 8), (64, 4, 1), (80, 3, 16), (40, 2, 8)],  # 80, 40: the generic path
)
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_a_quantized_cache_is_read_in_place_and_equals_the_dequantizing_reference(
    code_dtype, head_dim, group_size, block_size, query_dtype
):
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 97, 300]
    query, codes, scales, tables, lens = make_quantized_batch(
        seq_lens, block_size, 2, group_size, head_dim, code_dtype
    )
    query = query.to(query_dtype)
    scale = head_dim**-0.5
    out = paged_decode(query, codes, tables, lens, scale, scales)
    assert out.dtype == query_dtype
    # The same codes and scales, dequantized exactly in float32: the kernel differs only by
    # float32 rounding (the scale multiplies the dot product instead of each element), plus
    # the final narrowing for a bfloat16 query.
    expected = reference_decode(query, codes, scales, tables, lens, scale).to(query_dtype)
    tolerance = 1e-5 if query_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("head_dim", [64, 40])  # the register path and the generic one
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_every_finite_code_widens_to_its_exact_value(code_dtype, head_dim):
    # One token per sequence, so softmax weighs its V row 1 and the output is code * scale.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(code_dtype)
    codes = torch.where(codes.float().isfinite(), codes.float(), 0).to(code_dtype)
    num_seqs = -(-256 // head_dim)
    padded = torch.zeros(num_seqs * head_dim, dtype=code_dtype)
    padded[:256] = codes
    layer = torch.zeros(num_seqs, 2, 1, 1, head_dim, dtype=code_dtype)
    layer[:, 1, 0, 0] = padded.view(num_seqs, head_dim)
    scales = torch.ones(num_seqs, 2, 1, 1)
    scales[:, 1] = 0.375
    tables = torch.arange(num_seqs, dtype=torch.int32)[:, None]
    lens = torch.ones(num_seqs, dtype=torch.int32)
    query = torch.randn(num_seqs, 1, head_dim)
    out = paged_decode(query, layer, tables, lens, 1.0, scales)
    assert torch.equal(out.reshape(-1), padded.float() * 0.375)


def test_the_cpu_backend_decodes_a_quantized_cache_with_the_kernel(monkeypatch):
    calls = []

    def counting_decode(query, kv_cache_layer, block_tables, seq_lens, scale, kv_scales,
                        sliding_window, logit_softcap):
        calls.append(kv_scales is not None)
        return paged_decode(query, kv_cache_layer, block_tables, seq_lens, scale, kv_scales,
                            sliding_window, logit_softcap)

    monkeypatch.setattr(cpu_backend, "paged_decode", counting_decode)
    block_size, num_kv_heads, head_dim, group_size = 8, 2, 64, 3
    seq_lens, query_lens = [9, 30, 1, 12], [1, 1, 1, 5]  # three decodes, then an extend
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    tables = [list(range(1 + sum(blocks_per_seq[:i]), 1 + sum(blocks_per_seq[: i + 1])))
              for i in range(len(seq_lens))]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, length, new in zip(tables, seq_lens, query_lens, strict=True)
             for p in range(length - new, length)]
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, slots, KVLayout(block_size))
    generator = torch.Generator().manual_seed(7)
    num_blocks = 1 + sum(blocks_per_seq)
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=generator)
    codes, scales = quantize(cache, torch.int8)  # the earlier tokens' K/V
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_kv_heads * group_size, head_dim, generator=generator)
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=generator)
    outputs = []
    for backend in (CpuAttentionBackend(), TorchAttentionBackend()):
        layer, layer_scales = codes.clone(), scales.clone()
        outputs.append(backend.forward(query, key, value, layer, metadata, 0.125, layer_scales))
    assert calls == [True]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("head_dim", "group_size", "block_size"),
    [(64, 3, 16), (128, 4, 16), (64, 1, 5), (40, 2, 8), (128, 8, 1)],  # 40: the generic path
)
@pytest.mark.parametrize("sliding_window", [1, 7, 16, 100, 1000])
def test_paged_decode_with_a_sliding_window_attends_to_the_last_positions(
    sliding_window, head_dim, group_size, block_size
):
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 97, 300]
    query, layer, tables, lens, contexts = make_decode_batch(
        seq_lens, block_size, num_kv_heads=2, group_size=group_size, head_dim=head_dim
    )
    windows = [(keys[-sliding_window:], values[-sliding_window:]) for keys, values in contexts]
    scale = head_dim**-0.5
    out = paged_decode(query, layer, tables, lens, scale, sliding_window=sliding_window)
    torch.testing.assert_close(out, dense_decode(query, windows, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_a_quantized_cache_with_a_sliding_window_equals_the_reference(code_dtype, head_dim):
    seq_lens, sliding_window = [1, 9, 17, 97, 300], 20
    query, codes, scales, tables, lens = make_quantized_batch(seq_lens, 8, 2, 3, head_dim,
                                                              code_dtype)
    scale = head_dim**-0.5
    keys, values = gather_context(codes, tables, kv_scales=scales, dtype=torch.float32)
    windows = [(keys[i, :, max(0, n - sliding_window):n].transpose(0, 1),
                values[i, :, max(0, n - sliding_window):n].transpose(0, 1))
               for i, n in enumerate(lens.tolist())]
    out = paged_decode(query, codes, tables, lens, scale, scales, sliding_window)
    torch.testing.assert_close(out, dense_decode(query, windows, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("head_dim", "group_size", "block_size"),
    [(64, 3, 16), (128, 4, 16), (40, 2, 8)],  # 40: the generic path
)
@pytest.mark.parametrize("sliding_window", [None, 7, 100])
@pytest.mark.parametrize("logit_softcap", [1.0, 4.0])
def test_paged_decode_soft_caps_the_scores(logit_softcap, sliding_window, head_dim, group_size,
                                          block_size):
    seq_lens = [1, block_size + 1, 97, 300]
    query, layer, tables, lens, contexts = make_decode_batch(
        seq_lens, block_size, num_kv_heads=2, group_size=group_size, head_dim=head_dim
    )
    query = query * 3  # scores with a standard deviation of about 3: most exceed the cap
    windows = [(keys[-(sliding_window or 1000):], values[-(sliding_window or 1000):])
               for keys, values in contexts]
    scale = head_dim**-0.5
    out = paged_decode(query, layer, tables, lens, scale, sliding_window=sliding_window,
                       logit_softcap=logit_softcap)
    expected = dense_decode(query, windows, scale, logit_softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (expected - dense_decode(query, windows, scale)).abs().max() > 0.05  # it mattered


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_a_quantized_cache_with_a_window_and_a_soft_cap_equals_the_reference(code_dtype,
                                                                           head_dim):
    seq_lens, sliding_window, logit_softcap = [1, 9, 17, 97, 300], 20, 2.0
    query, codes, scales, tables, lens = make_quantized_batch(seq_lens, 8, 2, 3, head_dim,
                                                              code_dtype)
    query = query * 3
    scale = head_dim**-0.5
    keys, values = gather_context(codes, tables, kv_scales=scales, dtype=torch.float32)
    windows = [(keys[i, :, max(0, n - sliding_window):n].transpose(0, 1),
                values[i, :, max(0, n - sliding_window):n].transpose(0, 1))
               for i, n in enumerate(lens.tolist())]
    out = paged_decode(query, codes, tables, lens, scale, scales, sliding_window, logit_softcap)
    expected = dense_decode(query, windows, scale, logit_softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The cpu backend and the reference agree through the whole forward, decode and prefill.
    metadata = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables.tolist(),
                                       [0] * len(seq_lens), KVLayout(8))
    reference = TorchAttentionBackend()._decode(query, codes, metadata, scale, scales,
                                                sliding_window, logit_softcap)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_paged_decode_refuses_a_negative_soft_cap():
    query, layer, tables, lens, _ = make_decode_batch([5], 4, 2, 1, 64)
    with pytest.raises(RuntimeError, match="logit_softcap"):
        paged_decode(query, layer, tables, lens, 1.0, logit_softcap=-1.0)


@pytest.mark.parametrize("backend", [CpuAttentionBackend, TorchAttentionBackend])
def test_a_windowed_decode_never_reads_the_blocks_before_its_window(backend):
    # NaN in every block wholly before the window: one read of it would poison the output.
    block_size, sliding_window, seq_lens = 8, 12, [50, 9, 33]
    query, layer, tables, _, contexts = make_decode_batch(seq_lens, block_size, 2, 2, 64)
    for row, seq_len in enumerate(seq_lens):
        first_block = max(0, seq_len - sliding_window) // block_size
        layer[tables[row, :first_block].long()] = float("nan")
    windows = [(keys[-sliding_window:], values[-sliding_window:]) for keys, values in contexts]
    # Table padding names a finite spare block: the torch path gathers padding and masks it.
    used = [table[: -(-n // block_size)] for table, n in zip(tables.tolist(), seq_lens,
                                                             strict=True)]
    (spare, *_) = set(range(layer.shape[0])) - {block for table in used for block in table}
    padded = [table + [spare] * (tables.shape[1] - len(table)) for table in used]
    metadata = AttentionMetadata.build([1] * 3, seq_lens, padded, [0] * 3, KVLayout(block_size))
    out = backend()._decode(query, layer, metadata, 0.125, sliding_window=sliding_window)
    torch.testing.assert_close(out, dense_decode(query, windows, 0.125), atol=1e-5, rtol=1e-5)


def test_paged_decode_is_the_same_on_one_thread_and_many():
    seq_lens = [random.Random(3).randint(1, 400) for _ in range(37)]
    query, layer, tables, lens, _ = make_decode_batch(seq_lens, 16, 3, 3, 64, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = paged_decode(query, layer, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(paged_decode(query, layer, tables, lens, 0.125), single)


def test_paged_decode_rejects_bad_input_with_a_reason():
    query, layer, tables, lens, _ = make_decode_batch([5, 20], 16, 2, 2, 64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16 only"):
        paged_decode(query.double(), layer.double(), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode(query, layer, tables.long(), lens, 1.0)
    with pytest.raises(RuntimeError, match="out of range of the block tables"):
        paged_decode(query, layer, tables, torch.tensor([5, 33], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="out of range of the block tables"):
        paged_decode(query, layer, tables, torch.tensor([0, 20], dtype=torch.int32), 1.0)
    bad_tables = tables.clone()
    bad_tables[1, 1] = layer.shape[0]
    with pytest.raises(RuntimeError, match=f"block id {layer.shape[0]} out of range"):
        paged_decode(query, layer, bad_tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="head shapes disagree"):
        paged_decode(query[:, :3], layer, tables, lens, 1.0)
    codes, scales = quantize(layer, torch.int8)
    with pytest.raises(RuntimeError, match="int8 / float8 kv_cache needs its kv_scales"):
        paged_decode(query, codes, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="kv_scales belong to an int8 / float8 kv_cache"):
        paged_decode(query, layer, tables, lens, 1.0, scales)
    with pytest.raises(RuntimeError, match=r"kv_scales must be float32 \[num_blocks"):
        paged_decode(query, codes, tables, lens, 1.0, scales[:, :, :8])
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        paged_decode(query, layer, tables, lens, 1.0, sliding_window=-1)


def test_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KVPOOL_CPU_KERNELS", "0")
    cpu_kernels.load_cpu_kernels.cache_clear()
    cpu_kernels.cpu_kernels_available.cache_clear()
    try:
        with pytest.raises(cpu_kernels.CpuKernelsUnavailable, match="KVPOOL_CPU_KERNELS=0"):
            cpu_kernels.load_cpu_kernels()
        assert selector.resolve_backend_name("auto", "cpu") == "torch"
        with pytest.raises(ValueError, match="'cpu' is unavailable: turned off"):
            selector.resolve_backend_name("cpu", "cpu")
    finally:
        cpu_kernels.load_cpu_kernels.cache_clear()
        cpu_kernels.cpu_kernels_available.cache_clear()


def test_a_failed_build_falls_back_to_torch_with_one_warning(monkeypatch):
    from torch.utils import cpp_extension

    def failing_build(**_):
        raise RuntimeError("Error building extension 'kvpool_cpu_kernels'\nno compiler")

    monkeypatch.setattr(cpp_extension, "load", failing_build)
    cpu_kernels.load_cpu_kernels.cache_clear()
    cpu_kernels.cpu_kernels_available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="RuntimeError: Error building extension"):
            assert selector.resolve_backend_name("auto", "cpu") == "torch"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the outcome is cached: no second warning
            assert selector.resolve_backend_name("auto", "cpu") == "torch"
    finally:
        cpu_kernels.load_cpu_kernels.cache_clear()
        cpu_kernels.cpu_kernels_available.cache_clear()


def test_the_build_is_named_for_this_cpu():
    fingerprint = cpu_kernels.cpu_fingerprint()
    assert len(fingerprint) == 10 and fingerprint == cpu_kernels.cpu_fingerprint()
