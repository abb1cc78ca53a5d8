"""Random weights for a model shape, to measure throughput and memory without real weights.

Deterministic: the same config and seed give the same weights on the same device. Matrices are
drawn from N(0, 0.02^2) (the usual Llama initialiser, so activations stay finite in fp16/bf16)
and norm weights are 1. No tokenizer: prompts must be token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from kvpool.model.config import ModelConfig
from kvpool.model.llama import checkpoint_shapes
from kvpool.model.tokenizer import Tokenizer

_INIT_STD = 0.02


def _is_norm(name: str) -> bool:
    return name == "norm.weight" or name.endswith("layernorm.weight")


class DummyLoader:
    """`WeightLoader` that makes weights up."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed

    def load_config(self) -> ModelConfig:
        return self.config

    def iter_weights(
        self, config: ModelConfig, device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device=device).manual_seed(self.seed)
        for name, shape in checkpoint_shapes(config).items():
            if _is_norm(name):
                yield name, torch.ones(shape, device=device)
            else:
                weight = torch.randn(shape, generator=generator, device=device)
                yield name, weight.mul_(_INIT_STD)

    def load_tokenizer(self) -> Tokenizer | None:
        return None

    def load_generation_config(self) -> dict[str, Any]:
        return {}  # made-up weights have no sampling defaults
