"""A HuggingFace checkpoint of random weights (config.json + model.safetensors), for tests
that must load the same real weights more than once: tensor-parallel shards against tp=1."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvpool.model.config import ModelConfig
from kvpool.model.hf_config import plain_hf_config
from kvpool.model.llama import checkpoint_shapes


def save_hf_checkpoint(directory: Path, config: ModelConfig, seed: int = 0) -> Path:
    """Write `config`'s shapes with random weights, large enough that logits are far from
    zero and greedy decoding has no ties; returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(plain_hf_config(config)))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        tensors["model." + name] = noise.mul_(0.1).add_(1) if "norm" in name else noise * 0.2
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
