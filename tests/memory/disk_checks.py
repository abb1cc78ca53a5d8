"""Blocks, layouts and tiers the disk tier's tests share (imported by test modules of this
folder: test_disk_block_format, test_disk_tier, test_disk_tier_machine)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import hash_block
from kvpool.memory.tiers.disk_tier import DiskKVTier

DTYPES = ["float32", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"]
NAMESPACE = "models/tiny|layout-a"
BIG = 2**30  # a capacity nothing in these tests reaches


def make_layout(dtype: str = "float32", head_dim: int = 8) -> KVLayout:
    return KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype=dtype)


def block_tokens(key: int, layout: KVLayout) -> list[int]:
    """Three-digit ids, so every block's file has the same size."""
    return [100 + (key * layout.block_size + i) % 900 for i in range(layout.block_size)]


def make_block(layout: KVLayout, key: int):
    """(hash, token ids, kv, scales) of a block with random contents seeded by `key`."""
    generator = torch.Generator().manual_seed(key)
    if layout.dtype == "int8":
        kv = torch.randint(-128, 128, layout.block_shape, dtype=torch.int8, generator=generator)
    else:
        kv = (torch.randn(layout.block_shape, generator=generator) * 8).to(layout.torch_dtype)
    scales = (torch.rand(layout.scale_block_shape, generator=generator)
              if layout.is_quantized else None)
    tokens = block_tokens(key, layout)
    return hash_block(None, tokens), tokens, kv, scales


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def block_file(tier: DiskKVTier, block_hash: bytes) -> Path:
    name = block_hash.hex()
    return tier.directory / name[:2] / f"{name}.safetensors"


def stored_tier(tmp_path: Path, layout: KVLayout, keys, capacity: int = BIG) -> DiskKVTier:
    """A tier in `tmp_path / "disk"` holding the blocks of `keys`, written."""
    tier = DiskKVTier(tmp_path / "disk", capacity, layout, NAMESPACE)
    for key in keys:
        tier.store(*make_block(layout, key))
    tier.flush()
    return tier


def file_size(tmp_path: Path, layout: KVLayout) -> int:
    """Bytes of one block's file (the same for every key, see `block_tokens`)."""
    tier = DiskKVTier(tmp_path / "probe", BIG, layout, NAMESPACE)
    tier.store(*make_block(layout, 0))
    tier.close()
    return tier.stats().num_bytes


class Gate:
    """A stand-in for a CUDA event: `synchronize()` blocks the writer until the test opens it."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def synchronize(self) -> None:
        assert self.event.wait(timeout=10), "the test never opened the gate"

    def open(self) -> None:
        self.event.set()
