"""Checkpoint tensors that hold several projections in one (Phi-3's `qkv_proj` and
`gate_up_proj`), split into the projections' own names, which the model loads.

Layouts, the same in transformers' Phi-3 and in llama.cpp's `phi3` GGUF files (`attn_qkv`,
and `ffn_up` holding gate and up):

    qkv_proj      [q rows (num_heads * head_dim); k rows; v rows (num_kv_heads * head_dim each)]
    gate_up_proj  [gate rows (intermediate_size); up rows (intermediate_size)]

Why split instead of loading the fused tensor as it is: under tensor parallelism a rank's part
of `qkv_proj` is three ranges (its query heads' rows, its KV heads' k rows and v rows) and of
`gate_up_proj` two, which one `ShardSlice` cannot name. So a loader reads a fused tensor whole
(`shard_slice` knows no fused name: None, all of it), `split_fused` cuts it into the unfused
checkpoint tensors, and each is then sliced for the rank as an unfused checkpoint's would be.
The model's own parameters stay fused (one matmul each): the unfused names are views of them.
"""

from __future__ import annotations

import torch

from kvpool.model.config import ModelConfig

# Fused module (in a decoder layer) -> its parts, in the fused tensor's row order.
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def split_fused(config: ModelConfig, name: str,
                tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """The parts of the fused checkpoint tensor `name` (the whole tensor), as (checkpoint
    name, view of `tensor`) pairs; None for a name that is not fused. ValueError naming the
    tensor when its rows are not the parts' total (a fused tensor is never given sliced)."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] != "layers":
        return None
    module = f"{parts[2]}.{parts[3]}"
    names = FUSED_PARTS.get(module)
    if names is None:
        return None
    sizes = _row_counts(config, module)
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"fused checkpoint tensor {name!r} has {tensor.shape[0]} rows, the "
                         f"model expects {sum(sizes)} ({' + '.join(map(str, sizes))}: "
                         f"{', '.join(part.split('.')[1] for part in names)})")
    prefix, kind = f"{parts[0]}.{parts[1]}.", parts[4]
    return [(f"{prefix}{part}.{kind}", rows)
            for part, rows in zip(names, tensor.split(sizes, dim=0), strict=True)]


def _row_counts(config: ModelConfig, module: str) -> list[int]:
    if module == "mlp.gate_up_proj":
        return [config.intermediate_size] * 2
    kv_rows = config.num_kv_heads * config.head_dim
    return [config.num_heads * config.head_dim, kv_rows, kv_rows]
