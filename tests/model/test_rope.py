"""Rotary embeddings: frequencies match transformers for every supported scaling, and rotating
by absolute position makes attention scores depend only on relative position."""

from __future__ import annotations

import pytest
import torch

from kvpool.model.rope import apply_rotary, cos_sin_cache, inverse_frequencies

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def transformers_inv_freq(scaling: dict | None, theta: float, head_dim: int) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=params)
    if params["rope_type"] == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")[0]


LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("scaling", [None, LINEAR, LLAMA3], ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("theta,head_dim", [(10000.0, 64), (500000.0, 128)])
def test_inverse_frequencies_match_transformers(scaling, theta, head_dim):
    ours = inverse_frequencies(head_dim, theta, scaling)
    expected = transformers_inv_freq(scaling, theta, head_dim)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_freq_factors_reproduce_llama3_scaling():
    """GGUF files carry Llama 3.1 scaling as per-frequency divisors; the two forms agree."""
    plain, scaled = inverse_frequencies(128, 500000.0), inverse_frequencies(128, 500000.0, LLAMA3)
    factors = (plain / scaled).tolist()
    as_factors = {"rope_type": "freq_factors", "freq_factors": factors}
    from_factors = inverse_frequencies(128, 500000.0, as_factors)
    torch.testing.assert_close(from_factors, scaled)


def test_apply_rotary_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 32, generator=generator)  # [num_tokens, num_heads, head_dim]
    k = torch.randn(7, 2, 32, generator=generator)
    positions = torch.tensor([0, 1, 2, 9, 40, 41, 100])
    cos, sin = cos_sin_cache(32, 10000.0, 128)
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    # transformers' layout: [batch, heads, tokens, head_dim] with cos/sin [batch, tokens, head_dim]
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.transpose(0, 1), sin.transpose(0, 1)
    )
    torch.testing.assert_close(apply_rotary(q, cos, sin), expected_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), expected_k[0].transpose(0, 1))


def test_scores_depend_only_on_relative_position():
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 64, generator=generator), torch.randn(1, 1, 64, generator=generator)
    cos, sin = cos_sin_cache(64, 10000.0, 512)

    def score(query_position: int, key_position: int) -> float:
        rq = apply_rotary(q, cos[query_position].view(1, 1, -1), sin[query_position].view(1, 1, -1))
        rk = apply_rotary(k, cos[key_position].view(1, 1, -1), sin[key_position].view(1, 1, -1))
        return float((rq * rk).sum())

    assert score(10, 3) == pytest.approx(score(307, 300), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-4)
