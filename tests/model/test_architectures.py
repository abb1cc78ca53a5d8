"""Each architecture against transformers, float32, on a tiny random-weight checkpoint that
keeps its distinctive features: step logits through the paged cache, greedy generations
(batched and chunked against one at a time), prompt logprobs, and the GGUF file llama.cpp's
converter would write. Refusals name the feature a model uses that kvpool lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kvpool.model.gguf_config import config_from_gguf
from kvpool.model.hf_config import UnsupportedFeature, config_from_hf
from kvpool.model.layer_spec import MIXTRAL_NAMES, QWEN3_MOE_NAMES, MoEConfig
from kvpool.model.llama import checkpoint_shapes
from kvpool.model.loaders import load_model, make_loader
from kvpool.model.parallel import TensorParallel, take_slice
from kvpool.model.shard_slices import shard_slice
from tests.model.test_loaders import kvpool_step_logits, write_gguf

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def tiny_hf_config(kind: str, **overrides):
    """A shrunk config of `kind` that keeps what sets it apart."""
    import transformers

    if kind == "qwen3":  # QK-norm; head_dim 24, not hidden / heads = 16
        return transformers.Qwen3Config(**SHAPE, num_hidden_layers=2, head_dim=24,
                                        tie_word_embeddings=False, **overrides)
    if kind == "smollm3":  # no RoPE in every fourth layer (layer 3 of 4); tied embeddings
        return transformers.SmolLM3Config(**SHAPE, num_hidden_layers=4, pad_token_id=None,
                                          bos_token_id=None, eos_token_id=None, **overrides)
    if kind == "gemma3_text":  # 5 sliding (window 8, shorter than the prompts) : 1 full
        return transformers.Gemma3TextConfig(**{
            **SHAPE, "num_hidden_layers": 7, "head_dim": 24, "sliding_window": 8,
            "query_pre_attn_scalar": 20, "final_logit_softcapping": 30.0, **overrides})
    if kind == "gemma2":  # sliding (window 8) and full layers alternate; scores capped at 2
        return transformers.Gemma2Config(**{
            **SHAPE, "num_hidden_layers": 3, "head_dim": 24, "sliding_window": 8,
            "query_pre_attn_scalar": 20, "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 30.0, **overrides})
    if kind == "mistral":  # every layer windowed (8 tokens, shorter than the prompts)
        return transformers.MistralConfig(**SHAPE, num_hidden_layers=2, sliding_window=8,
                                          **overrides)
    if kind == "ministral":  # windowed and full layers as layer_types says
        return transformers.MinistralConfig(**{
            **SHAPE, "num_hidden_layers": 3, "sliding_window": 8, "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            **overrides})
    if kind == "qwen3_moe":  # 8 experts, top-2 renormalised; layer 1 keeps a dense MLP
        return transformers.Qwen3MoeConfig(**{
            **SHAPE, "num_hidden_layers": 3, "head_dim": 24, "moe_intermediate_size": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "mlp_only_layers": [1], **overrides})
    if kind == "mixtral":  # 8 experts, top-2, every layer sparse
        return transformers.MixtralConfig(**{
            **SHAPE, "num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 8,
            "num_experts_per_tok": 2, "head_dim": 16, **overrides})
    if kind == "phi3":  # fused projections; 3/4 of each head rotates; LongRoPE factors
        rotated = 12  # of head_dim 16
        return transformers.Phi3Config(**{
            **SHAPE, "num_hidden_layers": 2, "partial_rotary_factor": 0.75,
            "max_position_embeddings": 512, "original_max_position_embeddings": 128,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
            "rope_scaling": {"rope_type": "longrope",
                             "short_factor": [1.0 + 0.2 * i for i in range(rotated // 2)],
                             "long_factor": [3.0 + 0.5 * i for i in range(rotated // 2)]},
            **overrides})
    raise ValueError(kind)


GGUF_ARCHITECTURES = {"qwen3": "qwen3", "smollm3": "smollm3", "gemma3_text": "gemma3",
                      "gemma2": "gemma2", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# The architectures llama.cpp writes with their own name or as llama with experts (Mixtral; it
# writes Mistral as llama, without its window), and what it fixes rather than reads: Gemma 3's
# and Gemma 2's attention scale, head_dim ** -0.5; Qwen3-MoE's every layer sparse (no
# mlp_only_layers).
GGUF_OVERRIDES = {"gemma3_text": {"query_pre_attn_scalar": 24},
                  "gemma2": {"query_pre_attn_scalar": 24},
                  "qwen3_moe": {"mlp_only_layers": []}}


ARCHITECTURES = ["qwen3", "smollm3", "gemma3_text", "gemma2", "mistral", "ministral", "qwen3_moe",
                 "mixtral", "phi3"]


def save_tiny(directory: Path, kind: str, **overrides):
    """The transformers model, with weights large enough that logits are far from ties."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_hf_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return model


def hf_logits_at(model, token_ids: list[int], rows: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0, rows]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, save_tiny(directory, request.param)


def test_the_config_keeps_the_architectures_features(checkpoint):
    kind, directory, _ = checkpoint
    config = load_model(directory).config
    assert config.architecture == kind
    if kind == "qwen3":
        assert config.qk_norm and config.head_dim == 24 and not config.tie_word_embeddings
    if kind == "smollm3":
        assert [layer.rope is None for layer in config.layer_specs] == [False, False, False, True]
        assert config.tie_word_embeddings
    if kind == "phi3":
        assert {layer.rope.rotary_dim for layer in config.layer_specs} == {12}
        assert config.rope_scaling["rope_type"] == "longrope"
    if kind in ("qwen3_moe", "mixtral"):
        assert config.moe.num_experts == 8 and config.moe.top_k == 2
        sparse = [layer.sparse_mlp for layer in config.layer_specs]
        assert sparse == ([True, False, True] if kind == "qwen3_moe" else [True, True])
    if kind in ("mistral", "ministral"):
        windows = [layer.sliding_window for layer in config.layer_specs]
        assert windows == ([8, 8] if kind == "mistral" else [8, None, 8])
    if kind == "gemma3_text":
        windows = [layer.sliding_window for layer in config.layer_specs]
        assert windows == [8, 8, 8, 8, 8, None, 8]
        assert {layer.rope.theta for layer in config.layer_specs} == {10000.0, 1000000.0}
        assert config.sandwich_norms and config.norm_offset == 1.0 and config.qk_norm
    if kind == "gemma2":
        windows = [layer.sliding_window for layer in config.layer_specs]
        assert windows == [8, None, 8] and not config.qk_norm
        assert {layer.rope.theta for layer in config.layer_specs} == {10000.0}
        assert config.attn_logit_softcapping == 2.0 and config.final_logit_softcapping == 30.0
        assert config.sandwich_norms and config.norm_offset == 1.0


def test_step_logits_through_the_paged_cache_equal_transformers(checkpoint):
    _kind, directory, hf_model = checkpoint
    loaded = load_model(directory)
    token_ids = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    split = [30, 38, *range(39, 45)]  # prefill 30, continue with 8, then decode one by one
    ours = kvpool_step_logits(loaded, token_ids, split)
    reference = hf_logits_at(hf_model, token_ids, [end - 1 for end in [*split, 45]])
    assert reference.abs().max() > 1.0  # the check is not vacuous
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-5)  # |logits| up to ~30


def greedy_hf(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation, one full forward per token (no KV cache: the plain
    model is the reference; `generate` in transformers 5.25 diverged from it here)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(hf_logits_at(model, tokens, [len(tokens) - 1])[0].argmax()))
    return tokens[len(prompt):]


def test_greedy_generations_batched_and_chunked_equal_transformers(checkpoint):
    from kvpool import LLM, SamplingParams

    _kind, directory, hf_model = checkpoint
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 37, 90)]
    prompts.append([*prompts[1][:20], 7, 8])  # shares a prefix with another prompt
    llm = LLM(model=str(directory), dtype="float32", max_num_batched_tokens=32, block_size=8,
              kv_cache_memory=1 << 24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [greedy_hf(hf_model, p, 12) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in batched] == expected


def test_prompt_logprobs_equal_transformers(checkpoint):
    from kvpool import LLM, SamplingParams

    _kind, directory, hf_model = checkpoint
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = LLM(model=str(directory), dtype="float32", max_num_batched_tokens=16,
              kv_cache_memory=1 << 24)
    output = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    reference = torch.log_softmax(hf_logits_at(hf_model, prompt, list(range(39))), dim=-1)
    ours = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:],
                                                          strict=True)]
    expected = reference[torch.arange(39), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor(ours), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", sorted(GGUF_ARCHITECTURES))
def test_the_gguf_file_matches_transformers(kind, tmp_path):
    # write_gguf rounds this copy's weights to what the file holds
    directory = tmp_path / "hf"
    hf_model = save_tiny(directory, kind, **GGUF_OVERRIDES.get(kind, {}))
    path = tmp_path / f"tiny-{kind}.gguf"
    with torch.no_grad():
        write_gguf(path, hf_model, arch=GGUF_ARCHITECTURES[kind], qtype=GGMLQuantizationType.F16)
    loaded, hf_config = load_model(path), load_model(directory).config
    assert loaded.config.layer_specs == hf_config.layer_specs  # Qwen3-MoE: every layer sparse
    assert loaded.config.moe == hf_config.moe  # None for the dense models
    token_ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    split = [12, 17, 18, 19]
    ours = kvpool_step_logits(loaded, token_ids, split)
    reference = hf_logits_at(hf_model, token_ids, [end - 1 for end in [*split, 20]])
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-5)


def _greedy_with_prompt_logprobs(source: Path, prompt: list[int]) -> tuple[list[int], list]:
    from kvpool import LLM, SamplingParams

    llm = LLM(model=str(source), dtype="float32", max_num_batched_tokens=64,
              kv_cache_memory=1 << 24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    logprobs = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:],
                                                             prompt[1:], strict=True)]
    return list(output.outputs[0].token_ids), logprobs


def test_a_phi3_gguf_runs_as_its_safetensors_past_the_original_context(tmp_path):
    # llama.cpp's phi3 file: fused attn_qkv and ffn_up (gate rows, then up rows), partial rotary
    # as rope.dimension_count, LongRoPE's factors as tensors. A 150-token prompt and 12 greedy
    # tokens cross original_max_position_embeddings (128): short factors, then long ones.
    hf_model = save_tiny(tmp_path / "unrounded", "phi3")
    with torch.no_grad():
        write_gguf(tmp_path / "tiny.gguf", hf_model, arch="phi3",
                   qtype=GGMLQuantizationType.F16)
    hf_model.save_pretrained(tmp_path / "hf")  # the weights as the file holds them
    config, hf_config = (make_loader(tmp_path / name).load_config() for name in ("tiny.gguf", "hf"))
    assert [(spec.rope.rotary_dim, spec.sliding_window) for spec in config.layer_specs] == [
        (12, None)] * 2
    scaling, hf_scaling = config.rope_scaling, hf_config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 128
    for key in ("short_factor", "long_factor"):
        assert torch.equal(torch.tensor(scaling[key]), torch.tensor(hf_scaling[key]))
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(9)).tolist()
    tokens, logprobs = _greedy_with_prompt_logprobs(tmp_path / "tiny.gguf", prompt)
    hf_tokens, hf_logprobs = _greedy_with_prompt_logprobs(tmp_path / "hf", prompt)
    assert tokens == hf_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(hf_logprobs), atol=1e-5,
                               rtol=0)


PHI3_METADATA = {
    "general.architecture": "phi3", "phi3.block_count": 2, "phi3.embedding_length": 64,
    "phi3.feed_forward_length": 128, "phi3.attention.head_count": 4,
    "phi3.attention.head_count_kv": 2, "phi3.context_length": 512, "phi3.vocab_size": 256,
    "phi3.rope.dimension_count": 12, "phi3.rope.scaling.original_context_length": 128,
    "phi3.attention.sliding_window": 0,
}
PHI3_FACTORS = {"rope_factors_short.weight": [1.0] * 6, "rope_factors_long.weight": [2.0] * 6}


def test_a_phi3_gguf_without_factors_is_unscaled_and_its_window_is_read():
    config = config_from_gguf({**PHI3_METADATA, "phi3.attention.sliding_window": 2047}, [])
    assert config.rope_scaling is None  # Phi-3-mini-4k: no LongRoPE
    assert {(spec.rope.rotary_dim, spec.sliding_window) for spec in config.layer_specs} == {
        (12, 2047)}
    scaled = config_from_gguf(PHI3_METADATA, PHI3_FACTORS, PHI3_FACTORS)
    assert scaled.layer_specs[0].sliding_window is None  # 0: none (Phi-4-mini)
    assert scaled.layer_specs[0].rope.scaling["long_factor"] == (2.0,) * 6


@pytest.mark.parametrize(("drop", "lacking"), [
    ("rope_factors_long.weight", "rope_factors_long.weight"),
    ("phi3.rope.scaling.original_context_length", "original_context_length"),
])
def test_a_phi3_gguf_missing_part_of_longrope_is_refused_by_name(drop, lacking):
    metadata = {key: value for key, value in PHI3_METADATA.items() if key != drop}
    factors = {name: values for name, values in PHI3_FACTORS.items() if name != drop}
    with pytest.raises(ValueError, match=f"LongRoPE lacks.*{lacking}"):
        config_from_gguf(metadata, factors, factors)


QWEN3MOE_METADATA = {
    "general.architecture": "qwen3moe", "qwen3moe.block_count": 2,
    "qwen3moe.embedding_length": 64, "qwen3moe.feed_forward_length": 96,
    "qwen3moe.attention.head_count": 4, "qwen3moe.expert_count": 8,
    "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32,
    "tokenizer.ggml.tokens": ["a"] * 256,
}
QWEN3MOE_TENSORS = ["token_embd.weight", "blk.0.attn_q_norm.weight",
                    "blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"]


def test_a_qwen3moe_gguf_has_experts_in_every_layer_top_k_renormalised():
    config = config_from_gguf(QWEN3MOE_METADATA, QWEN3MOE_TENSORS)
    assert config.architecture == "qwen3_moe" and config.qk_norm
    assert config.moe == MoEConfig(64, 32, 8, 2, norm_topk_prob=True, names=QWEN3_MOE_NAMES)
    assert [layer.sparse_mlp for layer in config.layer_specs] == [True, True]
    # Without the expert width, llama.cpp's fallback: feed_forward_length / expert_used_count.
    metadata = {k: v for k, v in QWEN3MOE_METADATA.items() if "expert_feed" not in k}
    assert config_from_gguf(metadata, QWEN3MOE_TENSORS).moe.moe_intermediate_size == 48
    as_llama = {key.replace("qwen3moe", "llama"): value for key, value in metadata.items()}
    mixtral = config_from_gguf({**as_llama, "general.architecture": "llama"}, QWEN3MOE_TENSORS)
    assert mixtral.architecture == "mixtral" and mixtral.moe.names == MIXTRAL_NAMES
    assert mixtral.moe.moe_intermediate_size == 96  # Mixtral's experts: feed_forward_length


@pytest.mark.parametrize(("change", "match"), [
    ({"qwen3moe.expert_shared_count": 1}, "expert_shared_count=1"),
    ({"qwen3moe.expert_weights_scale": 2.5}, "expert_weights_scale=2.5"),
    ({"qwen3moe.expert_gating_func": 2}, "expert_gating_func=2"),  # sigmoid
    ({"general.architecture": "qwen3", "qwen3.expert_count": 8}, "qwen3.expert_count=8"),
], ids=["shared", "scale", "sigmoid", "qwen3"])
def test_gguf_experts_kvpool_cannot_run_are_refused_by_key(change, match):
    with pytest.raises(UnsupportedFeature, match=match):
        config_from_gguf({**QWEN3MOE_METADATA, **change}, QWEN3MOE_TENSORS)


def test_a_gguf_layer_without_experts_is_refused():
    # mlp_only_layers has no GGUF form: llama.cpp requires every qwen3moe layer's router.
    with pytest.raises(UnsupportedFeature, match=r"layers \[1\] have no experts"):
        config_from_gguf(QWEN3MOE_METADATA, QWEN3MOE_TENSORS[:-1])


def test_gguf_experts_under_tensor_parallelism_are_each_experts_slice(tmp_path):
    """Rank 1 of 2 reads, of every stacked expert tensor (Q8_0: gate/up rows cut from the raw
    blocks, down's 16 of 32 columns half a block, so dequantized whole), each expert's slice."""
    hf_model = save_tiny(tmp_path / "hf", "qwen3_moe", mlp_only_layers=[])
    path = tmp_path / "tiny.gguf"
    with torch.no_grad():
        write_gguf(path, hf_model, arch="qwen3moe", qtype=GGMLQuantizationType.Q8_0)
    loader = make_loader(path)
    config = loader.load_config()
    full = dict(loader.iter_weights(config, torch.device("cpu")))
    tp = TensorParallel(1, 2)
    sharded = dict(loader.iter_weights(config, torch.device("cpu"), tp))
    assert sharded.keys() == full.keys() == checkpoint_shapes(config).keys()
    for name, tensor in sharded.items():
        assert torch.equal(tensor, take_slice(full[name], shard_slice(config, tp, name))), name
    assert sharded["layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 16)
    assert sharded["layers.0.mlp.experts.7.up_proj.weight"].shape == (16, 64)
    assert sharded["layers.0.mlp.gate.weight"].shape == (8, 64)  # the router, replicated


def test_the_attention_soft_cap_changes_gemma2s_logits(tmp_path):
    # Not vacuous: the tiny Gemma 2's scores exceed its cap of 2, so the step test above
    # depends on it (transformers with the cap lifted disagrees).
    hf_model = save_tiny(tmp_path, "gemma2")
    token_ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    capped = hf_logits_at(hf_model, token_ids, list(range(20)))
    hf_model.config.attn_logit_softcapping = None
    for layer in hf_model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (capped - hf_logits_at(hf_model, token_ids, list(range(20)))).abs().max() > 1.0


@pytest.mark.parametrize(("kind", "field", "value"), [
    ("qwen3", "attn_logit_softcapping", 50.0),  # transformers' Qwen3 would ignore it
    ("llama", "attn_logit_softcapping", 30.0),
    ("qwen3", "use_sliding_window", True),
    ("qwen3", "attention_bias", True),
    ("smollm3", "mlp_bias", True),
    ("llama", "hidden_act", "gelu"),
])
def test_a_feature_kvpool_lacks_is_refused_by_name(kind, field, value):
    import transformers

    config = {"qwen3": transformers.Qwen3Config, "smollm3": transformers.SmolLM3Config,
              "llama": transformers.LlamaConfig}[kind](**SHAPE, num_hidden_layers=2)
    with pytest.raises(UnsupportedFeature, match=f"{field}={value!r} is not supported"):
        config_from_hf({**config.to_dict(), field: value})


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(UnsupportedFeature, match="unsupported architecture 'gemma'"):
        config_from_hf({"model_type": "gemma"})


def test_gemma3_may_soft_cap_its_attention_scores():
    # transformers' Gemma 3 attention caps its scores when the config says so (the released
    # checkpoints set None): the shared decoder hands the cap to the backend.
    config = config_from_hf(tiny_hf_config("gemma3_text", attn_logit_softcapping=20.0).to_dict())
    assert config.attn_logit_softcapping == 20.0
    assert config_from_hf(tiny_hf_config("gemma3_text").to_dict()).attn_logit_softcapping is None


def test_gemma2_gguf_without_keys_takes_llama_cpps_defaults():
    metadata = {"general.architecture": "gemma2", "gemma2.block_count": 4,
                "gemma2.embedding_length": 64, "gemma2.feed_forward_length": 128,
                "gemma2.attention.head_count": 4, "gemma2.attention.key_length": 24,
                "tokenizer.ggml.tokens": ["a"] * 256}
    config = config_from_gguf(metadata, ["token_embd.weight"])
    assert config.architecture == "gemma2" and config.tie_word_embeddings
    assert [layer.sliding_window for layer in config.layer_specs] == [4096, None, 4096, None]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.query_pre_attn_scalar == 24 and config.sandwich_norms and not config.qk_norm


def test_a_multimodal_gemma3_checkpoint_serves_its_text_decoder(tmp_path):
    # Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: a text decoder beside a
    # SigLIP vision tower. kvpool loads the decoder alone; on text its logits are the model's.
    import transformers

    # No final soft-capping: transformers' multimodal class does not apply it (its causal LM
    # does), and the released checkpoints set none.
    text = tiny_hf_config("gemma3_text", final_logit_softcapping=None)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=255,
                                       boi_token_index=253, eoi_token_index=254)
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.2)
    hf_model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config.architecture == "gemma3_text" and loaded.config.sandwich_norms
    token_ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    split = [20, *range(21, 30)]
    ours = kvpool_step_logits(loaded, token_ids, split)
    reference = hf_logits_at(hf_model, token_ids, [end - 1 for end in [*split, 30]])
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-5)


def test_longrope_switches_to_the_long_factors_past_the_original_context(tmp_path):
    # transformers' cached decoding rotates each new token by its position's factors: short
    # up to original_max_position_embeddings (128 here), long after. A 120-token prompt and 16
    # greedy tokens cross it.
    hf_model = save_tiny(tmp_path, "phi3")
    prompt = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        expected = []
        for _ in range(16):
            expected.append(int(out.logits[0, -1].argmax()))
            out = hf_model(torch.tensor([[expected[-1]]]), cache=out.past_key_values,
                           use_cache=True)
    from kvpool import LLM, SamplingParams

    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=1 << 24)
    output = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == expected

