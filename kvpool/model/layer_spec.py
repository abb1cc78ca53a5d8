"""What one decoder layer is: its attention span, its positional encoding, and its MLP (and
`MoEConfig`, the shape of a model's mixtures of experts, which its sparse layers share).

Models no longer repeat one layer `num_layers` times. Gemma 3 alternates five sliding-window
layers with one full-attention layer, each kind with its own RoPE base; SmolLM3 leaves every
fourth layer without any positional encoding (NoPE); Qwen3 may window its upper layers;
Qwen3-MoE may keep some layers' MLPs dense among the mixtures of experts. A
`ModelConfig` therefore carries one `LayerSpec` per layer (`ModelConfig.layer_specs`), built
by the readers of `config.json` and of GGUF metadata, and the model builds each layer from its
own spec.

Invariants: `sliding_window` is None (full causal attention) or a positive number of tokens
(a token attends to itself and the `sliding_window - 1` before it: the attention backends'
convention, `kvpool.attention.backend`); `rope` is None (no positional encoding) or a
`RopeSpec` whose `rotary_dim` is even and at most the head size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding of one kind of layer: base, scaling (`config.ROPE_TYPES`), and how
    many leading dimensions of each head rotate (all of them but for partial rotary)."""

    theta: float
    scaling: Mapping[str, Any] | None
    rotary_dim: int

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be positive and even, got {self.rotary_dim}")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer's attention span, positional encoding and kind of MLP."""

    rope: RopeSpec | None
    sliding_window: int | None = None
    sparse_mlp: bool = False  # the model's mixture of experts (`ModelConfig.moe`), not dense

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 token, got {self.sliding_window}")


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """How a Hub checkpoint names an MoE block's modules, relative to its decoder layer."""

    block: str  # the MoE block: holds `gate` (the router) and `experts.{e}`
    gate: str  # each expert's projections
    up: str
    down: str


QWEN3_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """One sparse MoE layer's shape and routing (every sparse layer of a model shares it)."""

    hidden_size: int
    moe_intermediate_size: int  # each expert's (Mixtral's `intermediate_size`)
    num_experts: int
    top_k: int  # experts per token (`num_experts_per_tok`)
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1 (Mixtral: always)
    names: ExpertNames = QWEN3_MOE_NAMES  # the Hub checkpoint's `per_expert` names

    def __post_init__(self) -> None:
        for field in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k"):
            if getattr(self, field) < 1:
                raise ValueError(f"MoE {field} must be >= 1, got {getattr(self, field)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoE top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
