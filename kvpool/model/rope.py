"""Rotary position embeddings: inverse frequencies (with scaling) and the cos/sin cache.

The model rotates by *absolute* position, looked up per token from a cache precomputed once for
`max_position_embeddings`, so tokens of many sequences at unrelated positions share one batch.
Layout is HuggingFace's "rotate half": dimension i pairs with i + head_dim / 2 (GGUF files store
Llama's Q/K rows interleaved instead; the GGUF loader undoes that before weights reach here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvpool.kernels import fused
from kvpool.model.config import ModelConfig


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """The `head_dim / 2` rotation frequencies, float32, after any scaling. # [head_dim // 2]"""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, and a smooth
    blend between the two wavelength thresholds."""
    factor = scaling["factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / scaling["low_freq_factor"]
    high_freq_wavelen = old_context / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def cos_sin_cache(
    head_dim: int,
    theta: float,
    max_positions: int,
    scaling: Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each (position, dimension) angle, float32. # [max_positions, head_dim] each

    `head_dim` is the rotated width (less than the head for partial rotary). LongRoPE (Phi-3)
    rotates each position by the short factors below `original_max_position_embeddings` and
    by the long ones from there on, both scaled by its attention factor: a token's rotation
    depends on its position only, as in transformers' cached decoding (its uncached forward
    of a sequence longer than that switches every position to the long factors)."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        return _longrope_cache(head_dim, theta, max_positions, scaling, device)
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
    return _cos_sin(inv_freq, torch.arange(max_positions, device=device))


def _cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(positions.float(), inv_freq)  # [positions, dim // 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _longrope_cache(head_dim: int, theta: float, max_positions: int,
                    scaling: Mapping[str, Any], device: torch.device | str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    tables = []
    for key, positions in (("short_factor", range(min(original, max_positions))),
                           ("long_factor", range(original, max_positions))):
        factors = torch.tensor(scaling[key], dtype=torch.float32)
        inv_freq = (1.0 / (factors * theta**exponents)).to(device)
        tables.append(_cos_sin(inv_freq, torch.tensor(positions, device=device)))
    cos, sin = (torch.cat(parts) * attention_factor for parts in zip(*tables, strict=True))
    return cos, sin


class StepRotary:
    """One step's rotary embedding: its tokens' positions over the model's float32 tables.

    `apply_(x)` rotates q or k [num_tokens, num_heads, head_dim] in place: with the fused C++
    kernel where it serves x (it looks each position up itself), else with `apply_rotary` on
    per-token rows gathered once per step and dtype, not once per layer.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
        self.cos, self.sin, self.positions = cos, sin, positions
        self._rows: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply_(self, x: torch.Tensor) -> None:
        x = x[..., : self.cos.shape[-1]]  # partial rotary: the leading dimensions only (a view)
        if fused.is_served(x):
            fused.rotary_(x, self.positions, self.cos, self.sin)
            return
        rows = self._rows.get(x.dtype)
        if rows is None:
            rows = tuple(table[self.positions].to(x.dtype).unsqueeze(1)
                         for table in (self.cos, self.sin))
            self._rows[x.dtype] = rows
        x.copy_(apply_rotary(x, *rows))


class NoRotary:
    """The rotary of a layer without positional encoding (NoPE: SmolLM3's every fourth layer):
    attention there sees token content only."""

    def apply_(self, x: torch.Tensor) -> None:
        pass


NO_ROTARY = NoRotary()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` # [num_tokens, num_heads, head_dim] by per-token `cos`/`sin`
    # [num_tokens, 1, head_dim], already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RopeTables(nn.Module):
    """The model's cos/sin tables, one pair per distinct `RopeSpec` among its layers, and which
    pair (or none: NoPE) each layer rotates with."""

    def __init__(self, config: ModelConfig, device: torch.device | str):
        super().__init__()
        specs = [layer.rope for layer in config.layer_specs]
        distinct = [rope for i, rope in enumerate(specs) if rope is not None
                    and rope not in specs[:i]]
        self.layer_tables = [None if rope is None else distinct.index(rope) for rope in specs]
        self.num_tables = len(distinct)
        for index, rope in enumerate(distinct):
            cos, sin = cos_sin_cache(rope.rotary_dim, rope.theta, config.max_position_embeddings,
                                     rope.scaling, device)
            self.register_buffer(f"cos_{index}", cos, persistent=False)  # [positions, dim]
            self.register_buffer(f"sin_{index}", sin, persistent=False)

    def for_step(self, positions: torch.Tensor) -> list[StepRotary | NoRotary]:
        """Each layer's rotary for a step's token positions."""
        tables = [StepRotary(getattr(self, f"cos_{i}"), getattr(self, f"sin_{i}"), positions)
                  for i in range(self.num_tables)]
        return [NO_ROTARY if index is None else tables[index] for index in self.layer_tables]
