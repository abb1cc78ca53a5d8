"""ModelConfig: presets, reading transformers and GGUF metadata, and validation."""

from __future__ import annotations

import json

import pytest

from kvpool.model import presets
from kvpool.model.config import ModelConfig
from kvpool.model.gguf_config import config_from_gguf
from kvpool.model.hf_config import config_from_hf, plain_hf_config
from kvpool.model.presets import PRESETS

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_presets_are_valid_and_named():
    assert {"tiny", "smollm2-135m", "llama-3-8b", "llama-3.1-8b", "qwen2-0.5b"} <= set(PRESETS)
    llama3 = presets.preset("llama-3-8b")
    shape = (llama3.num_layers, llama3.num_heads, llama3.num_kv_heads, llama3.head_dim)
    assert shape == (32, 32, 8, 128)
    assert llama3.num_queries_per_kv == 4
    with pytest.raises(ValueError, match="unknown preset 'gpt-5'"):
        presets.preset("gpt-5")


def test_from_transformers_llama_config():
    from transformers import LlamaConfig

    hf = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING},
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2, 3],
    )
    config = config_from_hf(hf.to_dict())
    assert config == ModelConfig(
        architecture="llama", vocab_size=1000, hidden_size=256, intermediate_size=512,
        num_layers=3, num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, max_position_embeddings=4096,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_ids=(2, 3),
    )


def test_from_transformers_4_style_rope_keys():
    """Older config.json files put rope_theta at the top level and call the type `type`."""
    legacy = {
        "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "rope_theta": 1234.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    config = config_from_hf(legacy)
    assert config.rope_theta == 1234.0 and config.num_kv_heads == 4
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_from_transformers_qwen2_and_mistral():
    from transformers import MistralConfig, Qwen2Config

    qwen = config_from_hf(Qwen2Config(num_hidden_layers=2).to_dict())
    assert qwen.architecture == "qwen2" and qwen.attention_bias
    mistral = config_from_hf(MistralConfig(sliding_window=4096).to_dict())
    assert mistral.max_position_embeddings == 131072  # no longer capped at the window
    assert {layer.sliding_window for layer in mistral.layer_specs} == {4096}
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        config_from_hf(Qwen2Config(use_sliding_window=True).to_dict())


def test_from_gguf_metadata():
    metadata = {
        "general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 2048,
        "llama.embedding_length": 128, "llama.feed_forward_length": 256,
        "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 500000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
        "tokenizer.ggml.tokens": ["a"] * 300, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 5,
    }
    config = config_from_gguf(metadata, ["token_embd.weight"])
    assert (config.vocab_size, config.head_dim, config.num_kv_heads) == (300, 32, 2)
    assert config.tie_word_embeddings  # no output.weight
    assert config.eos_token_ids == (2, 5)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    untied = config_from_gguf(metadata, ["token_embd.weight", "output.weight"])
    assert not untied.tie_word_embeddings
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        config_from_gguf({**metadata, "general.architecture": "gemma"}, [])


def test_smollm2_gguf_config_matches_transformers(smollm2, hf_smollm2):
    hf = hf_smollm2.config
    config = smollm2.config
    assert config == presets.preset("smollm2-135m").replace(rms_norm_eps=hf.rms_norm_eps)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads
    )
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.eos_token_ids == (hf.eos_token_id,) == (2,)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"architecture": "gpt2"}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ({"rope_scaling": {"rope_type": "freq_factors", "freq_factors": (1.0,)}}, "head_dim / 2"),
        ({"eos_token_ids": (512,)}, "outside vocab"),
        ({"rms_norm_eps": 0.0}, "must be positive"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be None or positive"),
        ({"final_logit_softcapping": -30.0}, "final_logit_softcapping must be None or positive"),
    ],
)
def test_validation_rejects_bad_configs(changes, message):
    with pytest.raises(ValueError, match=message):
        presets.preset("tiny").replace(**changes)


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "qwen2-0.5b", "llama-3-8b"])
def test_a_plain_preset_reads_back_from_its_config_json(name):
    config = presets.preset(name)
    assert config_from_hf(json.loads(json.dumps(plain_hf_config(config)))) == config


def test_a_config_with_per_layer_facts_has_no_plain_form():
    with pytest.raises(ValueError, match=r"no plain config\.json form"):
        plain_hf_config(presets.preset("gemma-3-1b"))

