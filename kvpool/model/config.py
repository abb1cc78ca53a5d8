"""`ModelConfig`: the shape and numerics of one decoder-only model, read from its weights'
metadata.

One config serves every source: a HuggingFace `config.json` (`kvpool.model.hf_config`), GGUF
key-values (`kvpool.model.gguf_config`), or a named preset (`preset`, for dummy weights and
tests: `kvpool.model.presets`). Llama 2/3, Mistral, SmolLM2/3, Qwen2, Qwen3 and Gemma 2 / 3
share one decoder; they differ only in the fields below: q/k/v biases (Qwen2), per-head RMSNorm
of queries and keys before RoPE (`qk_norm`: Qwen3, Gemma 3), Gemma's numerics (norms after
attention and MLP too, RMSNorm scaling by 1 + weight, GELU-tanh, scaled embeddings, its own
attention scale, soft-capped logits and, in Gemma 2, soft-capped attention scores), mixtures of
experts (`moe`: Qwen3-MoE, Mixtral), and per-layer facts in `layers` (`LayerSpec`: a sliding
window, its own RoPE, or no positional encoding as in SmolLM3's every fourth layer; a sparse or
a dense MLP).

Invariants (checked in `__post_init__`): every size is positive, `num_heads` is a multiple of
`num_kv_heads`, `head_dim` is even (rotary embeddings rotate pairs), `rope_scaling` is None or
a dict whose `rope_type` is one of `ROPE_TYPES` with that type's keys present, and `layers` is
empty (every layer full attention with the model's RoPE) or holds one spec per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.memory.kv_layout import KVLayout
from kvpool.model.layer_spec import LayerSpec, MoEConfig, RopeSpec

if TYPE_CHECKING:
    import torch

ARCHITECTURES = frozenset({"llama", "mistral", "ministral", "qwen2", "qwen3", "smollm3",
                           "gemma2", "gemma3_text", "qwen3_moe", "mixtral", "phi3"})
ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh"})  # of the gated MLP: act(gate) * up

# rope_type -> keys it needs. "freq_factors" divides each inverse frequency by a given factor:
# how GGUF files carry Llama 3.1 scaling (a `rope_freqs` tensor instead of key-values).
ROPE_TYPES: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "freq_factors": frozenset({"freq_factors"}),
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation (`ACTIVATIONS`)
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP too (Gemma)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): 1 in Gemma's checkpoints
    embedding_multiplier: float = 1.0  # embeddings × this, in the model's dtype (Gemma: √hidden)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma)
    final_logit_softcapping: float | None = None  # logits = cap · tanh(logits / cap) (Gemma)
    attn_logit_softcapping: float | None = None  # scores = cap · tanh(score / cap) (Gemma 2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layers: tuple[LayerSpec, ...] = ()  # one per layer; () = all full attention, the model's RoPE
    moe: MoEConfig | None = None  # the sparse layers' experts (`LayerSpec.sparse_mlp`)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            known = sorted(ARCHITECTURES)
            raise ValueError(f"unsupported architecture {self.architecture!r}; known: {known}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ValueError(f"{name} must be None or positive, got {cap!r}")
        for token_id in (*self.eos_token_ids, self.bos_token_id):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"special token id {token_id} outside vocab 0..{self.vocab_size}")
        _check_rope_scaling(self.rope_scaling, self.head_dim)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.hidden_act!r}")
        if any(layer.sparse_mlp for layer in self.layers) and self.moe is None:
            raise ValueError("a layer has a sparse MLP but the model has no experts (moe)")
        if self.layers and len(self.layers) != self.num_layers:
            raise ValueError(f"layers has {len(self.layers)} specs for {self.num_layers} layers")
        for layer in self.layers:
            if layer.rope is not None:
                _check_rope_scaling(layer.rope.scaling, layer.rope.rotary_dim)
                if layer.rope.rotary_dim > self.head_dim:
                    raise ValueError(f"rotary_dim {layer.rope.rotary_dim} exceeds head_dim "
                                     f"{self.head_dim}")

    @property
    def rope(self) -> RopeSpec:
        """The model's rotary embedding (layers without a spec of their own use it)."""
        return RopeSpec(self.rope_theta, self.rope_scaling, self.head_dim)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """One `LayerSpec` per layer."""
        return self.layers or (LayerSpec(self.rope),) * self.num_layers

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_layout(self, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> KVLayout:
        """The layout of this model's KV cache with blocks of `block_size` tokens, stored as
        `kv_cache_dtype` ("auto": the model's `dtype`); every KV head (a tensor-parallel rank
        replaces `num_kv_heads` with its share)."""
        return KVLayout.resolve(block_size, self.num_layers, self.num_kv_heads, self.head_dim,
                                str(dtype).removeprefix("torch."), kv_cache_dtype)

    # ------------------------------------------------------------ constructors
    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _check_rope_scaling(scaling: Mapping[str, Any] | None, head_dim: int) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {sorted(ROPE_TYPES)}")
    missing = ROPE_TYPES[rope_type] - scaling.keys()
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {sorted(missing)}")
    if rope_type == "freq_factors" and len(scaling["freq_factors"]) != head_dim // 2:
        raise ValueError(f"freq_factors needs head_dim / 2 = {head_dim // 2} entries")
