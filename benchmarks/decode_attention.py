"""Decode-attention benchmark: the Triton paged kernel against SDPA over a contiguous cache.

One query token per sequence, every sequence with the same context length, Llama-3-8B head
layout by default (32 query heads, 8 KV heads, head_dim 128), block size 16, bf16. The paged
cache's blocks are handed out in random order, as a long-running pool would; the baseline gets
the same K/V copied into one contiguous `[batch, num_kv_heads, context, head_dim]` tensor each
and runs `scaled_dot_product_attention` with the query heads of a group folded into the query
length (exact GQA with no K/V repetition, the fastest fair use of SDPA for decode).

Bytes counted per call: the K and V of every context token (what the kernel must read at
least); the query and output are negligible next to them. Rates are given as a fraction of
the machine's read bandwidth (a large reduction's, `device_timing.read_bandwidth`): attention
only reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from benchmarks.device_timing import median_seconds
from kvpool.memory.kv_layout import KVLayout

FULL_BATCHES = (1, 64, 256)
FULL_CONTEXTS = (2048, 8192)
SWEEP_SHAPES = ((64, 8192),)
SWEEP_CONFIGS = ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 3), (128, 8, 3))


# One layer of Llama-3-8B's KV cache in bf16 (frozen, so safe as a shared default).
LLAMA3_8B_LAYER_KV = KVLayout(block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """Query heads over one layer's KV layout (the KV facts are `KVLayout`'s)."""

    num_heads: int = 32
    kv: KVLayout = LLAMA3_8B_LAYER_KV

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.torch_dtype


@dataclass(frozen=True, slots=True)
class DecodeCase:
    """One shape's inputs: a paged cache and the same K/V laid out contiguously."""

    query: torch.Tensor  # [batch, num_heads, head_dim]
    kv_cache_layer: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [batch, blocks_per_seq] int32
    seq_lens: torch.Tensor  # [batch] int32
    keys: torch.Tensor  # [batch, num_kv_heads, context, head_dim]
    values: torch.Tensor  # [batch, num_kv_heads, context, head_dim]
    context: int


def make_case(
    kv_cache_layer: torch.Tensor, batch: int, context: int, layout: AttentionLayout, seed: int
) -> DecodeCase:
    """Random blocks of `kv_cache_layer` for `batch` sequences of `context` tokens."""
    device = kv_cache_layer.device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = layout.kv.num_blocks_for_tokens(context)
    num_blocks = kv_cache_layer.shape[0]
    assert batch * blocks_per_seq <= num_blocks, "the benchmark cache is too small"
    block_ids = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_seq]
    block_tables = block_ids.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    # [batch, blocks, 2, block_size, Hkv, D] -> [2, batch, Hkv, blocks * block_size, D]
    gathered = kv_cache_layer[block_tables.long()].permute(2, 0, 4, 1, 3, 5)
    contiguous = gathered.reshape(2, batch, layout.kv.num_kv_heads, -1, layout.kv.head_dim)
    contiguous = contiguous[:, :, :, :context].contiguous()
    query = torch.randn(batch, layout.num_heads, layout.kv.head_dim, generator=generator)
    return DecodeCase(
        query=query.to(device=device, dtype=layout.dtype),
        kv_cache_layer=kv_cache_layer,
        block_tables=block_tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        keys=contiguous[0],
        values=contiguous[1],
        context=context,
    )


def sdpa_decode(case: DecodeCase, scale: float) -> torch.Tensor:
    """The contiguous baseline: [batch, num_heads, head_dim]."""
    batch, num_heads, head_dim = case.query.shape
    num_kv_heads = case.keys.shape[1]
    grouped = case.query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, case.keys, case.values, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def triton_decode(case: DecodeCase, scale: float, config=None) -> torch.Tensor:
    from kvpool.attention.triton_decode import paged_decode

    return paged_decode(
        case.query,
        case.kv_cache_layer,
        case.block_tables,
        case.seq_lens,
        scale,
        max_seq_len=case.context,
        config=config,
    )


def bench_case(case: DecodeCase, layout: AttentionLayout, bandwidth: float) -> dict:
    """Both kernels' times on one shape; `bandwidth` is the read bandwidth, bytes/s."""
    from kvpool.attention.triton_decode import choose_num_splits

    device = case.query.device
    scale = layout.kv.head_dim**-0.5
    batch = case.query.shape[0]
    max_abs_diff = (triton_decode(case, scale) - sdpa_decode(case, scale)).abs().max().item()
    triton_s = median_seconds(lambda: triton_decode(case, scale), device)
    sdpa_s = median_seconds(lambda: sdpa_decode(case, scale), device)
    kv_bytes = batch * case.context * layout.kv.bytes_per_token  # one layer
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )
    return {
        "batch": batch,
        "context": case.context,
        "num_splits": choose_num_splits(batch, layout.kv.num_kv_heads, case.context, num_sms),
        "kv_bytes": kv_bytes,
        "triton_us": triton_s * 1e6,
        "sdpa_us": sdpa_s * 1e6,
        "triton_bytes_per_s": kv_bytes / triton_s,
        "sdpa_bytes_per_s": kv_bytes / sdpa_s,
        "triton_fraction_of_read_bandwidth": kv_bytes / triton_s / bandwidth,
        "sdpa_fraction_of_read_bandwidth": kv_bytes / sdpa_s / bandwidth,
        "speedup_vs_sdpa": sdpa_s / triton_s,
        "max_abs_diff_vs_sdpa": max_abs_diff,
    }


def sweep_configs(case: DecodeCase, layout: AttentionLayout) -> Iterator[dict]:
    """Kernel time of each tile configuration on one shape (informs `DecodeConfig`'s default),
    yielded as each is measured."""
    from kvpool.attention.triton_decode import DecodeConfig

    scale = layout.kv.head_dim**-0.5
    for block_n, num_warps, num_stages in SWEEP_CONFIGS:
        config = DecodeConfig(block_n, num_warps, num_stages)
        seconds = median_seconds(lambda c=config: triton_decode(case, scale, c), case.query.device)
        shape = {"batch": case.query.shape[0], "context": case.context}
        yield {**asdict(config), **shape, "triton_us": seconds * 1e6}


def measure(
    device: torch.device,
    bandwidth: float,
    batches: tuple[int, ...] = FULL_BATCHES,
    contexts: tuple[int, ...] = FULL_CONTEXTS,
    sweep_shapes: tuple[tuple[int, int], ...] = SWEEP_SHAPES,
    layout: AttentionLayout | None = None,
) -> Iterator[tuple[str, dict]]:
    """("shape", result) for every (batch, context), then ("tile_config", row) for the tile
    sweep, each yielded as soon as it is measured; one cache serves all shapes."""
    layout = layout or AttentionLayout()
    kv = layout.kv
    max_blocks = max(b * kv.num_blocks_for_tokens(c) for b in batches for c in contexts)
    shape = kv.tensor_shape(max_blocks)  # one layer: [max_blocks, 1, 2, block_size, Hkv, D]
    kv_cache_layer = torch.randn(shape, dtype=layout.dtype, device=device)[:, 0]
    for seed, (batch, context) in enumerate((b, c) for b in batches for c in contexts):
        yield "shape", bench_case(make_case(kv_cache_layer, batch, context, layout, seed),
                                  layout, bandwidth)
    for seed, (batch, context) in enumerate(sweep_shapes):
        for row in sweep_configs(make_case(kv_cache_layer, batch, context, layout, seed), layout):
            yield "tile_config", row


def layout_facts(layout: AttentionLayout) -> dict:
    kv = layout.kv
    return {"num_heads": layout.num_heads, "num_kv_heads": kv.num_kv_heads,
            "head_dim": kv.head_dim, "block_size": kv.block_size, "dtype": kv.dtype}
