"""`quantization`: a GGUF's blocks kept as stored (every matmul weight exactly the file's), and
int8/int4 quantized at load, on tiny models checked against transformers."""

from __future__ import annotations

import warnings

import pytest
import torch
from gguf import GGMLQuantizationType

from kvpool.kernels.quant_matmul import unpack
from kvpool.model.loaders import load_model
from kvpool.model.quantization import resolve_quantization
from tests.model.test_loaders import kvpool_step_logits, save_tiny_hf_model, write_gguf

Q = GGMLQuantizationType
TOKENS = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()
SPLIT = [12, 17, 18, 19]


def _hf_weight(hf_model, name: str) -> torch.Tensor:
    state = hf_model.state_dict()
    return state[name if name == "lm_head.weight" else f"model.{name}"]


def _reference_logits(hf_model) -> torch.Tensor:
    with torch.inference_mode():
        full = hf_model(torch.tensor([TOKENS])).logits[0]
    return full[[end - 1 for end in [*SPLIT, len(TOKENS)]]]


def _distance(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest logit difference over the reference logits' spread."""
    return ((ours - reference).abs() / reference.std(dim=-1, keepdim=True)).max().item()


@pytest.mark.parametrize(("kind", "arch", "qtype"), [
    ("llama", "llama", Q.Q4_1), ("qwen2", "qwen2", Q.Q8_0), ("llama3-tied", "llama", Q.Q4_0),
], ids=["llama-Q4_1", "qwen2-Q8_0", "tied-Q4_0"])
def test_gguf_blocks_are_kept_exactly_and_run(tmp_path, kind, arch, qtype):
    hf_model = save_tiny_hf_model(tmp_path / "hf", kind)
    path = tmp_path / "tiny.gguf"
    with torch.no_grad():  # also rounds hf_model's weights to the file's
        write_gguf(path, hf_model, arch=arch, qtype=qtype)
    loaded = load_model(path, quantization="gguf")
    sources = loaded.model.linear_sources()
    for linear, parts in sources:
        assert linear.quantized is not None, list(parts)
        expected = torch.cat([_hf_weight(hf_model, name) for name in parts])
        assert torch.equal(unpack(linear.quantized).dequantize(), expected), list(parts)
    if hf_model.config.tie_word_embeddings:  # one quantized table for the lookup and the head
        assert loaded.model.lm_head is loaded.model.embedding
    # The weights are the file's exactly; what moves the logits is the activations' rounding
    # to int8 on the way into each matmul (`kvpool.kernels.quant_matmul`, whose tests bound it
    # exactly). This random tiny model amplifies it to about a tenth of the logits' spread.
    ours = kvpool_step_logits(loaded, TOKENS, SPLIT)
    assert _distance(ours, _reference_logits(hf_model)) < 0.3


@pytest.mark.parametrize(("method", "tolerance"), [("int8", 0.3), ("int4", 1.0)])
def test_int8_and_int4_quantize_a_float_checkpoint(tmp_path, method, tolerance):
    hf_model = save_tiny_hf_model(tmp_path, "llama3-tied")
    loaded = load_model(tmp_path, quantization=method, quantization_group_size=16)
    bits = {"int8": 8, "int4": 4}[method]
    for linear, parts in loaded.model.linear_sources():
        weight = linear.quantized
        is_table = "embed_tokens.weight" in parts  # the tied table keeps 8 bits under int4
        assert (weight.bits, weight.group) == (8 if is_table else bits, 16)
        expected = torch.cat([_hf_weight(hf_model, name) for name in parts])
        step = unpack(weight).scales.float().repeat_interleave(16, dim=1)
        error = (unpack(weight).dequantize() - expected).abs()
        assert (error <= step / 2 + 2**-10 * (expected.abs() + step * 2**weight.bits)).all()
    # the tied embedding looks its rows up in the quantized head
    ids = torch.tensor([3, 0, 255])
    rows = loaded.model.embedding.rows(ids)
    assert torch.equal(rows, unpack(loaded.model.lm_head.quantized, ids).dequantize())
    ours = kvpool_step_logits(loaded, TOKENS, SPLIT)
    assert _distance(ours, _reference_logits(hf_model)) < tolerance


def test_a_group_size_that_does_not_divide_a_width_is_refused(tmp_path):
    save_tiny_hf_model(tmp_path, "llama")  # hidden 64, intermediate 128
    with pytest.raises(ValueError, match="quantization_group_size 48 does not divide the 64"):
        load_model(tmp_path, quantization="int4", quantization_group_size=48)


def test_choices_that_cannot_apply_are_refused():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="needs a GGUF file"):
        resolve_quantization("gguf", "safetensors", cpu)
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_quantization("int4", "gguf", cuda)
    with pytest.raises(ValueError, match="multiple of 8"):
        resolve_quantization("int4", "gguf", cpu, group_size=12)
    assert resolve_quantization(None, "gguf", cpu).method == "gguf"
    assert resolve_quantization(None, "gguf", cuda).method == "none"
    assert resolve_quantization(None, "safetensors", cpu).method == "none"


def test_quantized_types_without_a_kernel_are_dequantized_with_one_warning(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    # TQ2_0 (a type gguf can write, kvpool keeps no kernel for) needs rows of 256.
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(config).eval()
    path = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(path, hf_model, arch="llama", qtype=Q.TQ2_0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(path, quantization="gguf")
    named = [w for w in caught if "TQ2_0 tensors are dequantized at load" in str(w.message)]
    assert len(named) == 1
    assert all(linear.quantized is None for linear, _ in loaded.model.linear_sources())
    ours = kvpool_step_logits(loaded, TOKENS, SPLIT)
    torch.testing.assert_close(ours, _reference_logits(hf_model), atol=2e-5, rtol=1e-5)
