"""FLOP counts of the model's forward pass, from its config (matmuls and attention only: the
norms, activations and rotary embeddings are a rounding error next to them)."""

from __future__ import annotations

from kvpool.model.config import ModelConfig


def layer_weights(config: ModelConfig, layer_id: int = 0) -> int:
    """Weights one token meets in decoder layer `layer_id`'s projections (q, k, v, o, then
    the dense MLP's gate, up, down; or a mixture's router and its `top_k` experts')."""
    hidden, heads, kv_heads = config.hidden_size, config.num_heads, config.num_kv_heads
    attention = hidden * config.head_dim * (2 * heads + 2 * kv_heads)
    if not config.layer_specs[layer_id].sparse_mlp:
        return attention + 3 * hidden * config.intermediate_size
    moe = config.moe
    return attention + hidden * (moe.num_experts + 3 * moe.top_k * moe.moe_intermediate_size)


def token_flops(config: ModelConfig) -> int:
    """FLOPs of one token through every layer's projections (2 per multiply-add)."""
    return 2 * sum(layer_weights(config, layer_id) for layer_id in range(config.num_layers))


def key_flops(config: ModelConfig) -> int:
    """FLOPs of one query attending to one key, over every layer and head (scores and
    the weighted sum of values)."""
    return 4 * config.num_layers * config.num_heads * config.head_dim


def prefill_flops(config: ModelConfig, num_tokens: int, num_cached_tokens: int = 0) -> float:
    """FLOPs of computing the KV of tokens `num_cached_tokens .. num_tokens - 1` of one
    sequence (causal: the token at position p attends to p + 1 keys); no logits."""
    keys = num_tokens * (num_tokens + 1) // 2 - num_cached_tokens * (num_cached_tokens + 1) // 2
    return float((num_tokens - num_cached_tokens) * token_flops(config) + keys * key_flops(config))
