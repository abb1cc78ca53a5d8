"""A HuggingFace checkpoint of random weights (config.json + model.safetensors), for tests
that must load the same real weights more than once: tensor-parallel shards against tp=1."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvpool.model.config import ModelConfig
from kvpool.model.llama import checkpoint_shapes


def save_hf_checkpoint(directory: Path, config: ModelConfig, seed: int = 0) -> Path:
    """Write `config`'s shapes with random weights, large enough that logits are far from
    zero and greedy decoding has no ties; returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": config.architecture, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": config.eos_token_ids[0],
    }))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        tensors["model." + name] = noise.mul_(0.1).add_(1) if "norm" in name else noise * 0.2
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
