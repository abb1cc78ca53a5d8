"""The experts of a sparse MoE layer, computed by group: each expert once, on all its tokens.

The router gives every token `top_k` (expert, weight) pairs. `group_by_expert` sorts the
batch's `num_tokens * top_k` pairs by expert id (a stable argsort), so each expert's pairs form
one contiguous run of rows: `offsets[e]` is where expert e's run ends (the cumulative counts).
The experts then run as one matmul per run, never a loop over tokens:

    x[token_ids]            [num_pairs, hidden]            the pairs' inputs, grouped by expert
      @ w_gate_up[e].T      [num_pairs, 2 * intermediate]  each run by its own expert
      silu_and_mul          [num_pairs, intermediate]
      @ w_down[e].T         [num_pairs, hidden]
      * weights             scaled by the pair's routing weight, in float32
    index_add_ by token     [num_tokens, hidden]           float32 sums, rounded once

Two ways to run the per-expert matmuls: `torch._grouped_mm`, one call for all runs with the
offsets on the device (no host read), where this torch serves it; else a Python loop over the
experts that have pairs, which reads the counts to the host once per layer. Experts with no
pairs cost nothing in either (an empty run). Measured (`benchmarks/moe_experts.py`, a
Qwen3-30B-A3B layer: hidden 2048, 128 experts, top-8, intermediate 768; 2 shared cores, the
least of 9 interleaved runs, ms; routing ahead of them 0.3-2.6 ms):

    tokens                1      4      8     32    512
    fp32  loop         10.3   39.0   72.6  225.1  514.1
    fp32  grouped_mm   10.2   38.9   70.4  215.4  428.7
    bf16  loop          4.9   16.6   33.2   68.4  192.9
    bf16  grouped_mm    4.9   15.7   30.4   62.8  182.1

grouped_mm is never slower, so it is the CPU's path. Decode is bound by reading the active
experts' weights (batch 1: 8 experts, 75 MB in bf16); a padded `torch.bmm` over all experts
was faster only for fp32 at 32 tokens (173 ms) and slower elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpool.kernels import fused


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """A batch's (token, expert) pairs, sorted by expert (stable: by token within one)."""

    token_ids: torch.Tensor  # [num_pairs] int64: the token of each pair
    weights: torch.Tensor  # [num_pairs] float32: its routing weight
    offsets: torch.Tensor  # [num_experts] int32: the end of each expert's run of pairs

    @property
    def num_pairs(self) -> int:
        return self.token_ids.shape[0]


def group_by_expert(expert_ids: torch.Tensor, weights: torch.Tensor,
                    num_experts: int) -> ExpertGroups:
    """`expert_ids`, `weights`: [num_tokens, top_k] (int64, float32) -> the pairs by expert."""
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.flatten()  # [num_pairs], pair p is token p // top_k
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [num_experts]
    return ExpertGroups(
        token_ids=order // top_k,
        weights=weights.flatten()[order],
        offsets=counts.cumsum(0).to(torch.int32),
    )


def has_grouped_mm(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` serves `x`'s device and dtype here (torch >= 2.9 has a CPU
    kernel for float32 and bfloat16; CUDA needs sm90+, which it checks itself)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def experts_forward(x: torch.Tensor, groups: ExpertGroups, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, use_grouped_mm: bool | None = None) -> torch.Tensor:
    """The weighted sum of each token's experts' outputs. # [num_tokens, hidden] in x's dtype

    `w_gate_up` [num_experts, 2 * intermediate, hidden] (gate rows, then up rows) and
    `w_down` [num_experts, hidden, intermediate]. `use_grouped_mm` None picks by
    `has_grouped_mm`. Under tensor parallelism `intermediate` is this rank's slice and the
    result is its partial sum (the caller all-reduces)."""
    if use_grouped_mm is None:
        use_grouped_mm = has_grouped_mm(x)
    xs = x[groups.token_ids]  # [num_pairs, hidden], grouped by expert
    if use_grouped_mm:
        ys = _grouped_mm_experts(xs, groups.offsets, w_gate_up, w_down)
    else:
        ys = _looped_experts(xs, groups.offsets, w_gate_up, w_down)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, groups.token_ids, ys * groups.weights.unsqueeze(1))
    return out.to(x.dtype)


def _grouped_mm_experts(xs: torch.Tensor, offsets: torch.Tensor, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor) -> torch.Tensor:
    gate_up = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offsets)
    return torch._grouped_mm(fused.silu_and_mul(gate_up), w_down.transpose(1, 2), offs=offsets)


def _looped_experts(xs: torch.Tensor, offsets: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    ys = torch.empty_like(xs)
    start = 0
    for expert_id, end in enumerate(offsets.tolist()):  # the one host read of the layer
        if end > start:
            gate_up = F.linear(xs[start:end], w_gate_up[expert_id])
            ys[start:end] = F.linear(fused.silu_and_mul(gate_up), w_down[expert_id])
        start = end
    return ys
