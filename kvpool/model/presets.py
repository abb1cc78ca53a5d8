"""Named model shapes for dummy weights, tests and benchmarks (`preset`): the real
models' `config.json` facts, no weights.

The newer presets are written as the model's own `config.json` fields (`CONFIG_JSON`) and read
by the same reader as a downloaded model (`kvpool.model.hf_config`), so per-layer facts
(SmolLM3's NoPE layers) come from one place, and a checkpoint of random weights for another
engine is written from the same fields (`preset_config_json`).
"""

from __future__ import annotations

from typing import Any

from kvpool.model.config import ModelConfig
from kvpool.model.hf_config import config_from_hf, plain_hf_config

_LLAMA_3_VOCAB = dict(vocab_size=128256, bos_token_id=128000)
# Phi-4-mini-instruct's LongRoPE factors, one per rotated pair (96 of each head's 128
# dimensions rotate): config.json's `rope_scaling` as published (the short ones are all 1.0).
_PHI_4_MINI_LONG_FACTOR = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023,
    4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372,
    10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807,
    22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66,
    32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]

_LEGACY: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-2-7b": ModelConfig(
        architecture="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "qwen2-0.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True, bos_token_id=151643, eos_token_ids=(151645, 151643),
    ),
}

# The newer presets as their models' `config.json` fields (the facts a checkpoint of random
# weights is written from: `preset_config_json`).
CONFIG_JSON: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        model_type="llama", **_LLAMA_3_VOCAB, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
        eos_token_id=[128001, 128008, 128009],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=[151645, 151643],
    ),
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=[151645, 151643],
    ),
    "smollm3-3b": dict(
        model_type="smollm3", **_LLAMA_3_VOCAB, hidden_size=2048, intermediate_size=11008,
        num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
        rms_norm_eps=1e-6, rope_theta=5000000.0, max_position_embeddings=65536,
        tie_word_embeddings=True, eos_token_id=128012, no_rope_layer_interval=4,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "gemma-3-1b": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=[1, 106], hidden_activation="gelu_pytorch_tanh",
    ),
    # The text decoder of Gemma 3 4B (a multimodal checkpoint's text_config).
    "gemma-3-4b": dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
        rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=10000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106],
        hidden_activation="gelu_pytorch_tanh",
    ),
    # Phi-4-mini-instruct: fused checkpoints, 3/4 of each head rotates, LongRoPE past 4096
    # tokens; its window (262144) exceeds its context, so attention is full in effect.
    "phi-4-mini": dict(
        model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        partial_rotary_factor=0.75, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                      "long_factor": _PHI_4_MINI_LONG_FACTOR},
        sliding_window=262144, tie_word_embeddings=True, bos_token_id=199999,
        eos_token_id=200020,
    ),
}


PRESETS: dict[str, ModelConfig] = {
    **_LEGACY, **{name: config_from_hf(fields) for name, fields in CONFIG_JSON.items()}}


def preset(name: str) -> ModelConfig:
    """A named model shape (weights come from elsewhere or are random)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None



def preset_config_json(name: str) -> dict[str, Any]:
    """The `config.json` fields of a preset, as transformers or vLLM read them beside random
    weights (`benchmarks.random_checkpoint`)."""
    if name in CONFIG_JSON:
        return dict(CONFIG_JSON[name])
    return plain_hf_config(preset(name))
