"""The experts of one sparse MoE layer on the CPU: the ways to run the per-expert matmuls.

    python -m benchmarks.moe_experts [--threads N] [--repeats R]

A Qwen3-30B-A3B-shaped layer (hidden 2048, 128 experts, top-8, moe_intermediate 768; random
weights: 2.4 GB in float32, 1.2 GB in bfloat16), random routing, decode batches (1-32 tokens)
and a 512-token prefill, in float32 and bfloat16. Each variant computes the same
`experts_forward` (the routing is done once, outside the timing):

    loop         a Python loop over the experts with pairs, F.linear on each run (one host read)
    grouped_mm   torch._grouped_mm over all runs, offsets on the device (no host read)
    bmm_padded   every expert's run padded to the longest, one torch.bmm over all experts
                 (one host read for the longest run)
    routing      (not a variant: what precedes them all) router matmul, softmax, top-k, grouping

Prints one JSON line per measurement (the least and the median milliseconds of `--repeats`
runs, interleaved) and a table of the least (the machine is shared: the least is the least
disturbed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch

from kvpool.kernels import fused
from kvpool.model.moe import route
from kvpool.model.moe_experts import ExpertGroups, experts_forward, group_by_expert

HIDDEN, NUM_EXPERTS, TOP_K, INTERMEDIATE = 2048, 128, 8, 768
BATCHES = (1, 4, 8, 32, 512)


def bmm_padded(x: torch.Tensor, groups: ExpertGroups, w_gate_up: torch.Tensor,
               w_down: torch.Tensor) -> torch.Tensor:
    counts = torch.diff(groups.offsets, prepend=groups.offsets.new_zeros(1)).long()
    longest = int(counts.max())
    starts = groups.offsets.long() - counts
    rank_in_run = torch.arange(groups.num_pairs) - starts.repeat_interleave(counts)
    expert_of_pair = torch.arange(NUM_EXPERTS).repeat_interleave(counts)
    padded = x.new_zeros(NUM_EXPERTS, longest, x.shape[1])
    padded[expert_of_pair, rank_in_run] = x[groups.token_ids]
    gate_up = torch.bmm(padded, w_gate_up.transpose(1, 2))
    act = fused.silu_and_mul(gate_up.flatten(0, 1)).view(NUM_EXPERTS, longest, -1)
    ys = torch.bmm(act, w_down.transpose(1, 2))[expert_of_pair, rank_in_run]
    out = torch.zeros(x.shape, dtype=torch.float32)
    out.index_add_(0, groups.token_ids, ys * groups.weights.unsqueeze(1))
    return out.to(x.dtype)


def routing(x: torch.Tensor, router: torch.Tensor) -> ExpertGroups:
    """What runs ahead of the experts: router matmul, softmax, top-k, grouping."""
    weights, expert_ids = route(x @ router.T, TOP_K, norm_topk_prob=True)
    return group_by_expert(expert_ids, weights, NUM_EXPERTS)


VARIANTS = {
    "loop": lambda x, g, wgu, wd: experts_forward(x, g, wgu, wd, use_grouped_mm=False),
    "grouped_mm": lambda x, g, wgu, wd: experts_forward(x, g, wgu, wd, use_grouped_mm=True),
    "bmm_padded": bmm_padded,
}


def time_round_robin(calls: dict, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of each call, `repeats` times, the calls interleaved so that a neighbour's
    load on this shared machine falls on all of them alike; one warm-up call each first."""
    for call in calls.values():
        call()  # oneDNN primitives, the allocator
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        w_gate_up = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.02).to(dtype)
        w_down = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE) * 0.02).to(dtype)
        router = (torch.randn(NUM_EXPERTS, HIDDEN) * 0.02).to(dtype)
        for num_tokens in BATCHES:
            x = torch.randn(num_tokens, HIDDEN).to(dtype)
            scores = torch.rand(num_tokens, NUM_EXPERTS)
            weights, expert_ids = scores.topk(TOP_K, dim=-1)
            groups = group_by_expert(expert_ids, weights, NUM_EXPERTS)
            calls = {name: functools.partial(variant, x, groups, w_gate_up, w_down)
                     for name, variant in VARIANTS.items()
                     if name != "bmm_padded" or num_tokens >= 32}  # else all 128 experts' work
            reference = calls["loop"]().float()
            diffs = {name: float((call().float() - reference).abs().max())
                     for name, call in calls.items()}
            calls["routing"] = functools.partial(routing, x, router)
            diffs["routing"] = 0.0
            for name, times in time_round_robin(calls, args.repeats).items():
                row = {"dtype": str(dtype).removeprefix("torch."), "num_tokens": num_tokens,
                       "variant": name, "min_ms": round(min(times), 2),
                       "median_ms": round(statistics.median(times), 2), "max_diff": diffs[name]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    columns = [*VARIANTS, "routing"]
    print(f"\n{'dtype':9} {'tokens':>6}  " + "  ".join(f"{n:>11}" for n in columns))
    for dtype in args.dtypes:
        for num_tokens in BATCHES:
            cells = {r["variant"]: r["min_ms"] for r in rows
                     if r["dtype"] == dtype and r["num_tokens"] == num_tokens}
            print(f"{dtype:9} {num_tokens:>6}  "
                  + "  ".join(f"{cells.get(n, float('nan')):>11.2f}" for n in columns))


if __name__ == "__main__":
    main()
