"""`kvpool bench kv-capacity`: how many KV blocks and tokens one budget holds per KV dtype.

For each `kv_cache_dtype` the model's KV layout is built (`ModelConfig.kv_layout`), the budget is
cut into blocks exactly as the engine cuts it (`num_blocks_for_memory`, the null block
included), and the KV memory is really allocated (`KVMemory`: the arena of codes plus, for int8
and fp8, the scale pool), so the bytes reported are the tensors' own sizes, not a formula's.
Only the model's config is read (GGUF metadata), never its weights.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory

KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
GIB = 2**30


def measure_capacity(layout: KVLayout, budget_bytes: int) -> dict:
    """Allocate a pool of `layout` in `budget_bytes` and report what it holds."""
    num_blocks = layout.num_blocks_for_memory(budget_bytes) - 1  # the null block is a row too
    memory = KVMemory(layout, num_blocks, enable_prefix_caching=False)
    kv_cache = memory.kv_cache
    scale_bytes = 0 if kv_cache.scales is None else kv_cache.scales.nbytes
    allocated = memory.arena.num_reserved_bytes + scale_bytes
    return {
        "storage_dtype": layout.dtype,
        "bytes_per_token": layout.bytes_per_token,
        "scale_bytes_per_token": layout.scale_bytes_per_token,
        "bytes_per_block": layout.bytes_per_block,
        "num_blocks": memory.max_num_blocks,
        "num_tokens": memory.max_num_blocks * layout.block_size,
        "allocated_bytes": allocated,
    }


def run_capacity(model: str | None, block_size: int, budget_bytes: int,
                 kv_dtypes: tuple[str, ...] = KV_DTYPES) -> dict:
    """One row per KV dtype, with token ratios against float32 and bfloat16."""
    from kvpool.model.loaders.auto import make_loader

    config = make_loader(model).load_config()
    rows = {}
    for kv_dtype in kv_dtypes:
        layout = config.kv_layout(block_size, torch.float32, kv_dtype)
        rows[kv_dtype] = measure_capacity(layout, budget_bytes)
    for row in rows.values():
        for base in ("float32", "bfloat16"):
            if base in rows:
                row[f"tokens_over_{base}"] = row["num_tokens"] / rows[base]["num_tokens"]
    return {"model": model or "SmolLM2-135M-Instruct", "block_size": block_size,
            "budget_bytes": budget_bytes, "kv_cache_dtypes": rows}


def format_capacity(result: dict) -> str:
    budget_gib = result["budget_bytes"] / GIB
    shown = f"{budget_gib:g} GiB" if budget_gib >= 1 else f"{result['budget_bytes'] / 2**20:g} MiB"
    lines = [f"KV capacity of {shown} for {result['model']} "
             f"(blocks of {result['block_size']} tokens; allocated, not computed)",
             f"  {'kv_cache_dtype':<14} {'B/token':>8} {'of it scales':>12} {'blocks':>8} "
             f"{'tokens':>9} {'tokens/GiB':>10} {'× fp32':>7} {'× bf16':>7}"]
    for name, row in result["kv_cache_dtypes"].items():
        per_gib = row["num_tokens"] / budget_gib
        lines.append(f"  {name:<14} {row['bytes_per_token']:>8,} "
                     f"{row['scale_bytes_per_token']:>12,} {row['num_blocks']:>8,} "
                     f"{row['num_tokens']:>9,} {per_gib:>10,.0f} "
                     f"{row.get('tokens_over_float32', 0):>6.2f}× "
                     f"{row.get('tokens_over_bfloat16', 0):>6.2f}×")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The benchmark of `kvpool bench kv-capacity` (flags: kvpool.cli.bench)."""
    if args.hybrid:
        from kvpool.bench import hybrid_capacity

        return hybrid_capacity.run(args)
    result = run_capacity(args.model, args.block_size, args.kv_cache_memory)
    print(json.dumps(result) if args.json else format_capacity(result))
    return 0
