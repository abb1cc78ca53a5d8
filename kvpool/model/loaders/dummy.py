"""Random weights for a model shape, to measure throughput and memory without real weights.

Deterministic: the same config and seed give the same weights on the same device. Matrices are
drawn from N(0, 0.02^2) (the usual Llama initialiser, so activations stay finite in fp16/bf16)
and norm weights are 1. No tokenizer: prompts must be token ids. Under tensor parallelism each
rank draws only its local shapes, from the same seed: the values are not slices of the tp=1
weights, and need not be.

Drawing is the cost of a large dummy model (billions of normal samples take minutes on a CPU),
so a matrix larger than `DRAWN_ELEMENTS` repeats one block of that many drawn values, drawn
once per load and stored as bfloat16 (half the bytes to write; exact in a bf16 model): an 8B
shape then starts in seconds. Smaller matrices (every small preset's) are
drawn in full, as before. A repeated block makes rows of a large vocabulary's embedding equal,
and so exact ties among the logits of a tied head: a comparison of tokens across engines asks
for every matrix drawn in full (`drawn_elements=None`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from kvpool.model.config import ModelConfig
from kvpool.model.llama import checkpoint_shapes
from kvpool.model.parallel import TensorParallel
from kvpool.model.tokenizer import Tokenizer

_INIT_STD = 0.02
DRAWN_ELEMENTS = 1 << 24  # 16M: the largest matrix drawn in full; larger ones repeat a block
_TILED_DTYPE = torch.bfloat16  # repeated blocks are written at half the bytes of float32


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")  # every RMSNorm: final, per layer, per head (QK-norm)


class DummyLoader:
    """`WeightLoader` that makes weights up."""

    def __init__(self, config: ModelConfig, seed: int = 0,
                 drawn_elements: int | None = DRAWN_ELEMENTS) -> None:
        """`drawn_elements`: the largest matrix drawn in full; None draws every one in full
        (slower, but no two rows of a large matrix repeat, so logits have no exact ties)."""
        self.config = config
        self.seed = seed
        self.drawn_elements = drawn_elements

    def load_config(self) -> ModelConfig:
        return self.config

    def iter_weights(
        self, config: ModelConfig, device: torch.device,
        tp: TensorParallel = TensorParallel.single(),  # noqa: B008 (frozen, immutable)
    ) -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device=device).manual_seed(self.seed)
        block: torch.Tensor | None = None  # drawn at the first matrix too large to draw
        for name, shape in checkpoint_shapes(config, tp).items():
            if _is_norm(name):
                yield name, torch.ones(shape, device=device)
                continue
            if self.drawn_elements is None or math.prod(shape) <= self.drawn_elements:
                weight = torch.empty(shape, device=device)
                yield name, weight.normal_(0.0, _INIT_STD, generator=generator)
                continue
            if block is None:
                block = torch.empty(self.drawn_elements, device=device)
                block = block.normal_(0.0, _INIT_STD, generator=generator).to(_TILED_DTYPE)
            yield name, _tiled(torch.empty(shape, dtype=_TILED_DTYPE, device=device), block)

    def load_tokenizer(self) -> Tokenizer | None:
        return None

    def load_generation_config(self) -> dict[str, Any]:
        return {}  # made-up weights have no sampling defaults


def _tiled(weight: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """`weight` filled with `block` repeated (flat order)."""
    flat = weight.view(-1)
    for start in range(0, flat.numel(), block.numel()):
        chunk = flat[start : start + block.numel()]
        chunk.copy_(block[: chunk.numel()])
    return weight
