"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router, then `top_k` of
`num_experts` SwiGLU experts per token, their outputs summed with the router's weights.

Routing follows transformers' `Qwen3MoeTopKRouter` / `MixtralTopKRouter` step for step, so that
the same experts are chosen (ties included): logits = x @ gate.T in the model's dtype; softmax
over all experts in float32; top-k of the probabilities; divided by their sum when
`norm_topk_prob` (Mixtral: always). The weights then stay float32: each expert output is scaled
and summed in float32 and rounded to the model's dtype once (transformers' Qwen3-MoE rounds the
weights to the model's dtype first and sums in it; in float32 the two agree to summation order,
in bfloat16 ours is the closer to exact). The experts run grouped (`kvpool.model.moe_experts`).

Weights are stacked: `w_gate_up` [num_experts, 2 * intermediate, hidden] (each expert's gate
rows, then its up rows: one matmul, then `silu_and_mul`) and `w_down` [num_experts, hidden,
intermediate]; the router `gate` [num_experts, hidden]. `checkpoint_tensors(layout)` names
views of them, relative to the decoder layer (`layers.N.`), in three layouts:

    per_expert  the Hub's checkpoints, and what transformers 5's `save_pretrained` writes:
                Qwen3-MoE `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`;
                Mixtral `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1`
                (gate), `w3` (up), `w2` (down) `.weight`
    fused       transformers 5's in-memory `state_dict()` (both models): `mlp.gate.weight`,
                `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]
    stacked     llama.cpp's GGUF tensors under the names `GGUF_BLOCK_PART_NAMES` gives them:
                `mlp.gate.weight`, `mlp.experts.{gate,up}_proj.weight` [E, I, H],
                `mlp.experts.down_proj.weight` [E, H, I]

Tensor parallelism: every rank holds every expert, each sliced along its intermediate dimension
(rank r: units [r I/tp, (r+1) I/tp) of each expert's gate, up and down), as the dense MLP is
sliced; the router is replicated, so every rank routes alike. Each rank's down projections give
partial sums, all-reduced once per layer (one collective, as for the dense MLP; no all-to-all).
`shard_slice` says which part of a full checkpoint tensor a rank needs. The `fused` layout
cannot be sliced in one range (a rank's gate and up rows are two ranges): it loads at tp=1 only.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from torch import nn

from kvpool.model.layer_spec import MIXTRAL_NAMES, MoEConfig
from kvpool.model.linear import Linear, empty_parameter
from kvpool.model.moe_experts import experts_forward, group_by_expert
from kvpool.model.parallel import ShardSlice, TensorParallel

CheckpointLayout = Literal["per_expert", "fused", "stacked"]

# llama.cpp's GGUF tensor parts of an MoE block -> checkpoint module names (the `stacked`
# layout), in the form of `kvpool.model.loaders.gguf_file`'s table: `blk.N.<part>.weight` ->
# `layers.N.<module>.weight`. GGUF's numpy shapes: ffn_gate_inp [E, H], ffn_gate_exps and
# ffn_up_exps [E, I, H], ffn_down_exps [E, H, I]: the stacked parameters' own layouts.
GGUF_BLOCK_PART_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


# config.json fields of the MoE architectures, decided one by one: refused (we would compute
# something else), or ignored with the reason.
_REFUSED_FIELDS = {
    "shared_expert_intermediate_size": "shared experts (Qwen2-MoE)",
    "n_shared_experts": "shared experts (DeepSeek)",
}
_IGNORED_FIELDS = {
    "router_jitter_noise": "transformers applies it in training only",
    "router_aux_loss_coef": "a training loss",
    "output_router_logits": "a training output",
}


def moe_config_from_hf(hf: dict[str, Any]) -> MoEConfig | None:
    """The sparse layers' `MoEConfig` of a HuggingFace config.json (Qwen3-MoE, Mixtral); None
    for a model without experts. ValueError naming the field or model_type we do not
    implement (`_REFUSED_FIELDS`; `_IGNORED_FIELDS` are let through, with the reason)."""
    model_type = hf.get("model_type")
    for field, what in _REFUSED_FIELDS.items():
        if hf.get(field):
            raise ValueError(f"config field {field}={hf[field]}: {what} are not implemented")
    if model_type not in ("qwen3_moe", "mixtral"):
        if any(hf.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError(f"mixture-of-experts model_type {model_type!r} is not implemented "
                             "(only qwen3_moe and mixtral)")
        return None
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field hidden_act={hf['hidden_act']!r}: experts use silu only")
    if model_type == "mixtral":
        return MoEConfig(hf["hidden_size"], hf["intermediate_size"], hf["num_local_experts"],
                         hf["num_experts_per_tok"], norm_topk_prob=True, names=MIXTRAL_NAMES)
    # The Hub's Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts.
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not num_experts:
        return None
    return MoEConfig(hf["hidden_size"], hf["moe_intermediate_size"], num_experts,
                     hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False)))


def is_sparse_layer(hf: dict[str, Any], layer_id: int) -> bool:
    """Whether decoder layer `layer_id` has the MoE MLP (else the dense one, of the model's
    `intermediate_size`): transformers' rule, `decoder_sparse_step` and `mlp_only_layers`
    (Qwen3-MoE); every layer for Mixtral."""
    if moe_config_from_hf(hf) is None:
        return False
    step = hf.get("decoder_sparse_step", 1)
    return layer_id not in (hf.get("mlp_only_layers") or []) and (layer_id + 1) % step == 0


def route(logits: torch.Tensor, top_k: int,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [num_tokens, num_experts] -> (weights [num_tokens, top_k] float32,
    expert_ids [num_tokens, top_k] int64), in transformers' order (module docstring)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class SparseMoE(nn.Module):
    """The MoE MLP of one decoder layer: forward(x [num_tokens, hidden]) -> [num_tokens,
    hidden], the dense `MLP`'s call shape. Under `tp` this rank's slice of every expert."""

    def __init__(self, config: MoEConfig, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = TensorParallel.single()):  # noqa: B008 (frozen)
        super().__init__()
        if config.moe_intermediate_size % tp.size:
            raise ValueError(f"tensor_parallel_size {tp.size} does not divide the model's "
                             f"moe_intermediate_size ({config.moe_intermediate_size})")
        self.config = config
        self.tp = tp
        self.intermediate_size = len(tp.shard(config.moe_intermediate_size))  # this rank's
        hidden, num_experts, local = config.hidden_size, config.num_experts, self.intermediate_size
        self.gate = Linear(hidden, num_experts, False, dtype, device)  # the router, replicated
        self.w_gate_up = empty_parameter(num_experts, 2 * local, hidden, dtype=dtype, device=device)
        self.w_down = empty_parameter(num_experts, hidden, local, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce_(self.partial_forward(x))

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the output (the output itself at tp=1): its slice of
        every expert's intermediate units. # [num_tokens, hidden]"""
        weights, expert_ids = route(self.gate(x), self.config.top_k, self.config.norm_topk_prob)
        groups = group_by_expert(expert_ids, weights, self.config.num_experts)
        return experts_forward(x, groups, self.w_gate_up, self.w_down)

    def checkpoint_tensors(self, layout: CheckpointLayout = "per_expert"
                           ) -> dict[str, torch.Tensor]:
        """Checkpoint name (relative to the decoder layer) -> the view of the parameter it
        fills: this rank's slice, which `shard_slice` says how to cut from the full tensor."""
        if layout not in ("per_expert", "fused", "stacked"):
            raise ValueError(f"unknown MoE checkpoint layout {layout!r}")
        if layout == "fused" and self.tp.is_parallel:
            raise ValueError("the fused gate_up_proj layout loads at tensor_parallel_size 1 only "
                             "(a rank's gate and up rows are two ranges of it)")
        gate, up = self.w_gate_up.split(self.intermediate_size, dim=1)  # [E, I_local, H] each
        if layout == "fused":
            return {"mlp.gate.weight": self.gate.weight,
                    "mlp.experts.gate_up_proj": self.w_gate_up,
                    "mlp.experts.down_proj": self.w_down}
        if layout == "stacked":
            return {"mlp.gate.weight": self.gate.weight,
                    "mlp.experts.gate_proj.weight": gate, "mlp.experts.up_proj.weight": up,
                    "mlp.experts.down_proj.weight": self.w_down}
        names = self.config.names
        targets = {f"{names.block}.gate.weight": self.gate.weight}
        for expert_id in range(self.config.num_experts):
            prefix = f"{names.block}.experts.{expert_id}."
            targets[f"{prefix}{names.gate}.weight"] = gate[expert_id]
            targets[f"{prefix}{names.up}.weight"] = up[expert_id]
            targets[f"{prefix}{names.down}.weight"] = self.w_down[expert_id]
        return targets



def checkpoint_slices(config: MoEConfig, tp: TensorParallel,
                      layout: CheckpointLayout = "per_expert") -> dict[str, ShardSlice]:
    """Every checkpoint name of `layout` (relative to the decoder layer) -> the (dimension,
    range) of the full tensor `tp`'s rank needs, or None where it needs all of it (the
    router; everything at tp=1). No memory is used: the shapes come from meta modules."""
    return dict(_slices(config, tp.rank, tp.size, layout))


def shard_slice(config: MoEConfig, tp: TensorParallel, name: str) -> ShardSlice:
    """`checkpoint_slices`' entry for one name of any layout; None for a name no layout has
    (the model's `load_weights` rejects those). ValueError for the fused layout at tp > 1."""
    if not tp.is_parallel:
        return None
    if name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        checkpoint_slices(config, tp, "fused")  # raises: a rank's rows are two ranges
    for layout in ("per_expert", "stacked"):
        slices = _slices(config, tp.rank, tp.size, layout)
        if name in slices:
            return slices[name]
    return None


@functools.cache
def _slices(config: MoEConfig, rank: int, size: int,
            layout: CheckpointLayout) -> dict[str, ShardSlice]:
    """The sliced dimension of each tensor is the one where the rank's shape differs from the
    full shape: only the intermediate dimension is ever split. (Cached by rank and size: a
    `TensorParallel`'s process group need not be hashable.)"""
    tp = TensorParallel(rank, size)
    full = SparseMoE(config, torch.float32, "meta").checkpoint_tensors(layout)
    local = SparseMoE(config, torch.float32, "meta", tp).checkpoint_tensors(layout)
    part = tp.shard(config.moe_intermediate_size)
    slices: dict[str, ShardSlice] = {}
    for name, tensor in full.items():
        split = [dim for dim, (whole, mine) in enumerate(zip(tensor.shape, local[name].shape,
                                                             strict=True)) if whole != mine]
        slices[name] = (split[0], slice(part.start, part.stop)) if split else None
    return slices
