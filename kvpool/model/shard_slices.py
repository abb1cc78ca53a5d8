"""Which part of each checkpoint tensor a tensor-parallel rank reads (`shard_slice`), by the
tensor's name alone: no model is built, so a loader reads only that part from disk.

A module is split along one dimension in units of query heads, KV heads, intermediate (FFN)
units or vocabulary rows (`_SPLITS`); a rank's range of units comes from `TensorParallel`. A
sparse layer's experts are split by `kvpool.model.moe.shard_slice`.
"""

from __future__ import annotations

from kvpool.model.config import ModelConfig
from kvpool.model.moe import shard_slice as moe_shard_slice
from kvpool.model.parallel import ShardSlice, TensorParallel

# Module -> (dimension it is split along, the unit of the split): "heads" (query heads),
# "kv_heads", "ffn" (intermediate units) or "vocab" (rows of the vocabulary).
_SPLITS = {
    "embed_tokens": (0, "vocab"), "lm_head": (0, "vocab"),
    "self_attn.q_proj": (0, "heads"), "self_attn.o_proj": (1, "heads"),
    "self_attn.k_proj": (0, "kv_heads"), "self_attn.v_proj": (0, "kv_heads"),
    "mlp.gate_proj": (0, "ffn"), "mlp.up_proj": (0, "ffn"), "mlp.down_proj": (1, "ffn"),
}


def shard_slice(config: ModelConfig, tp: TensorParallel, name: str) -> ShardSlice:
    """The (dimension, range) of the full checkpoint tensor `name` that `tp`'s rank needs, or
    None where it needs all of it: always at tp=1, for norms, for a replicated KV head, and
    for names the model does not know (`load_weights` rejects those). A loader that reads only
    that part gives `load_weights` the shapes it expects; no model is built."""
    if tp.is_parallel and config.moe is not None and _is_expert_name(config, name):
        return moe_shard_slice(config.moe, tp, name.split(".", 2)[2])
    split = _SPLITS.get(_module_name(name)) if tp.is_parallel else None
    if split is None:
        return None
    dim, unit = split
    part, total, width = {  # this rank's range of units, the number of units, their width
        "heads": (tp.shard(config.num_heads), config.num_heads, config.head_dim),
        "kv_heads": (tp.kv_heads(config.num_kv_heads), config.num_kv_heads, config.head_dim),
        "ffn": (tp.shard(config.intermediate_size), config.intermediate_size, 1),
        "vocab": (tp.shard(config.vocab_size), config.vocab_size, 1),
    }[unit]
    if len(part) == total:
        return None
    return dim, slice(part.start * width, part.stop * width)


def _is_expert_name(config: ModelConfig, name: str) -> bool:
    """Whether `name` is a tensor of a sparse layer's mixture of experts (router included)."""
    parts = name.split(".", 3)
    return (len(parts) == 4 and parts[0] == "layers"
            and config.layer_specs[int(parts[1])].sparse_mlp
            and parts[2] == config.moe.names.block)


def _module_name(name: str) -> str:
    """`layers.3.mlp.up_proj.weight` -> `mlp.up_proj`; `embed_tokens.weight` -> `embed_tokens`."""
    module = name.rsplit(".", 1)[0]
    parts = module.split(".", 2)
    return parts[2] if parts[0] == "layers" and len(parts) == 3 else module
