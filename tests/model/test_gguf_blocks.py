"""GGML blocks as `GroupQuantized`, against gguf's reference dequantization: bit for bit for
Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, within the float16 rounding of each sub-block scale and min
for the K-quants (whose codes are still exactly the stored quants); the bundled SmolLM2 GGUF's
own tensors, and Llama's Q/K row un-permutation applied to the quantized form."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvpool.model import default_model_path
from kvpool.model.loaders.gguf_blocks import KEPT_TYPES, to_group_quantized
from kvpool.model.loaders.gguf_file import tensor_bytes, torch_shape, unpermute_rows

Q = GGMLQuantizationType
EXACT = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
FORM = {  # type -> (bits, group) of its GroupQuantized
    Q.Q4_0: (4, 32), Q.Q4_1: (4, 32), Q.Q5_0: (8, 32), Q.Q5_1: (8, 32), Q.Q8_0: (8, 32),
    Q.Q4_K: (4, 32), Q.Q5_K: (8, 32), Q.Q6_K: (8, 16),
}
# Byte offsets of each block's float16 fields: random bytes there could be inf/NaN.
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
              Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SHAPES = [(rows, cols) for rows in (1, 16, 48) for cols in (32, 256, 512, 576)]


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random bytes in `qtype`'s layout for a `shape` matrix, with float16 fields drawn from
    N(0, 0.1^2) (either sign). # [num_blocks, block_bytes] uint8"""
    rng = np.random.default_rng(seed)
    block_numel, block_bytes = GGML_QUANT_SIZES[qtype]
    num_blocks = shape[0] * shape[1] // block_numel
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        fields = (rng.standard_normal(num_blocks) * 0.1).astype(np.float16)
        blocks[:, offset : offset + 2] = fields.view(np.uint8).reshape(num_blocks, 2)
    return blocks


def quantized_blocks(qtype: GGMLQuantizationType, shape: tuple[int, int], seed: int) -> np.ndarray:
    """gguf's own quantization of a random normal matrix. # [rows, row_bytes] uint8"""
    weights = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return gguf_quantize(weights, qtype)


def reference(blocks: np.ndarray, qtype: GGMLQuantizationType,
              shape: tuple[int, int]) -> torch.Tensor:
    weights = gguf_dequantize(blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype)
    return torch.from_numpy(weights.astype(np.float32)).reshape(shape)


def convert(blocks: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]):
    quantized = to_group_quantized(torch.from_numpy(blocks.reshape(-1)), qtype, shape)
    assert (quantized.bits, quantized.group) == FORM[qtype] and quantized.shape == shape
    assert quantized.scales.dtype == quantized.mins.dtype == torch.float16
    assert int(quantized.codes.max()) < 2 ** {Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 6}.get(
        qtype, quantized.bits)
    return quantized


def test_kept_types_are_the_eight_with_a_form():
    assert set(FORM) == KEPT_TYPES


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
def test_symmetric_and_affine_blocks_dequantize_bit_for_bit(qtype, shape):
    for seed, blocks in enumerate([quantized_blocks(qtype, shape, 0),
                                   random_blocks(qtype, shape, 1)]):
        ours = convert(blocks, qtype, shape).dequantize()
        assert torch.equal(ours, reference(blocks, qtype, shape)), f"source {seed}"


def unit_scale_blocks(qtype: GGMLQuantizationType, blocks: np.ndarray) -> np.ndarray:
    """`blocks` with d = 1, dmin = 0 and every sub-block scale 1 and min 0, so that gguf's
    dequantization returns the stored quants themselves (less 32 for Q6_K)."""
    unit = blocks.copy()
    one = np.array([1], np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        unit[:, 192:208] = 1  # int8 scales
        unit[:, 208:210] = one
        return unit
    unit[:, 0:2], unit[:, 2:4] = one, 0  # d, dmin
    unit[:, 4:8], unit[:, 8:12], unit[:, 12:16] = 1, 0, 0x01  # scales 0-3, mins 0-3, 4-7 packed
    return unit


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % 256 == 0], ids=str)
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_k_quant_codes_are_the_stored_quants(qtype, shape):
    blocks = random_blocks(qtype, shape, seed=2)
    codes = convert(blocks, qtype, shape).codes
    quants = reference(unit_scale_blocks(qtype, blocks), qtype, shape) + (32 * (qtype == Q.Q6_K))
    assert torch.equal(codes.float(), quants)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % 256 == 0], ids=str)
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_k_quants_dequantize_within_float16_rounding_of_scales(qtype, shape):
    blocks = random_blocks(qtype, shape, seed=3)
    quantized = convert(blocks, qtype, shape)
    expected = reference(blocks, qtype, shape)
    ours = quantized.dequantize()
    # Each rounded scale and min is off by at most 2^-11 of itself (2^-25 absolute among
    # float16's subnormals); both sides then round once in float32.
    group = quantized.group
    scales = quantized.scales.float().abs().repeat_interleave(group, dim=1)
    mins = quantized.mins.float().abs().repeat_interleave(group, dim=1)
    codes = quantized.codes.float()
    bound = 2**-11 * 1.001 * (codes * scales + mins) + (codes + 1) * 2**-25 + 2**-22 * ours.abs()
    assert bool(((ours - expected).abs() <= bound).all())
    assert not torch.equal(ours, expected)  # the bound is what is tested, not equality


def test_q6_k_weights_are_quant_less_32_times_the_rounded_scale():
    shape = (16, 512)
    quantized = convert(random_blocks(Q.Q6_K, shape, seed=4), Q.Q6_K, shape)
    assert torch.equal(quantized.mins, -32 * quantized.scales)


@pytest.mark.parametrize(("qtype", "scale"), [(Q.Q8_0, 600.0), (Q.Q4_0, 9000.0)])
def test_a_min_past_float16_range_is_refused(qtype, scale):
    blocks = random_blocks(qtype, (1, 32), seed=5)
    blocks[:, 0:2] = np.array([scale], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="overflows float16"):
        to_group_quantized(torch.from_numpy(blocks.reshape(-1)), qtype, (1, 32))


def test_other_types_and_split_blocks_are_refused():
    blocks = torch.zeros(2 * 34, dtype=torch.uint8)  # two Q8_0 blocks
    with pytest.raises(ValueError, match="Q3_K blocks are not kept"):
        to_group_quantized(torch.zeros(110, dtype=torch.uint8), Q.Q3_K, (1, 256))
    with pytest.raises(ValueError, match="rows of 16 weights"):
        to_group_quantized(blocks, Q.Q8_0, (4, 16))
    with pytest.raises(ValueError, match="needs 136 bytes"):
        to_group_quantized(blocks, Q.Q8_0, (2, 64))


@pytest.fixture(scope="module")
def smollm2_tensors():
    reader = GGUFReader(default_model_path())
    heads = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].parts[-1][0])
    return {tensor.name: tensor for tensor in reader.tensors}, heads, kv_heads


def test_smollm2_q4_1_and_q8_0_tensors_convert_exactly(smollm2_tensors):
    tensors, _, _ = smollm2_tensors
    for name in ("blk.0.attn_k.weight", "blk.3.ffn_down.weight"):
        tensor = tensors[name]
        assert tensor.tensor_type == Q.Q4_1
        raw, shape = tensor_bytes(tensor), torch_shape(tensor)
        ours = to_group_quantized(raw, Q.Q4_1, shape).dequantize()
        assert torch.equal(ours, reference(raw.numpy(), Q.Q4_1, shape))
    embedding = tensors["token_embd.weight"]  # Q8_0 [49152, 576]: its first 2048 rows
    assert embedding.tensor_type == Q.Q8_0
    shape = (2048, torch_shape(embedding)[1])
    raw = tensor_bytes(embedding)[: shape[0] * shape[1] // 32 * 34]
    ours = to_group_quantized(raw, Q.Q8_0, shape).dequantize()
    assert torch.equal(ours, reference(raw.numpy(), Q.Q8_0, shape))


@pytest.mark.parametrize("projection", ["attn_q", "attn_k"])
def test_unpermuting_quantized_rows_matches_unpermuting_the_weights(smollm2_tensors, projection):
    tensors, heads, kv_heads = smollm2_tensors
    tensor = tensors[f"blk.1.{projection}.weight"]
    num_heads = heads if projection == "attn_q" else kv_heads
    raw, shape = tensor_bytes(tensor), torch_shape(tensor)
    quantized = to_group_quantized(raw, tensor.tensor_type, shape)
    unpermuted = quantized.map_rows(lambda rows: unpermute_rows(rows, num_heads))
    expected = unpermute_rows(reference(raw.numpy(), tensor.tensor_type, shape), num_heads)
    assert torch.equal(unpermuted.dequantize(), expected)
    assert not torch.equal(unpermuted.dequantize(), quantized.dequantize())
