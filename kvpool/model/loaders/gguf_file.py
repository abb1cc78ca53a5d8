"""Weights, config and tokenizer from a GGUF file (llama.cpp's format), read with `gguf`.

The file is parsed once; its key-values give the config and tokenizer, its tensors are
dequantized one at a time (see `dequant`) on the target device. GGUF names map to checkpoint
names (`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`).

Why Q/K rows are permuted back: llama.cpp's converter reorders each head's Q and K rows from
HuggingFace's rotate-half layout (dimension i pairs with i + head_dim/2) to interleaved pairs
(2i with 2i+1), which its rotary kernel expects. Our rotary embedding uses the rotate-half layout,
so for `llama` files the rows are put back. Qwen2 files are written without the reordering.

Sampling defaults: llama.cpp's converter copies a model's generation_config.json into
`general.sampling.*` keys; `load_generation_config` gives them back under HF's names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor

from kvpool.model.config import ModelConfig
from kvpool.model.loaders.dequant import dequantize
from kvpool.model.tokenizer import Tokenizer

# general.sampling.<key> -> generation_config.json's name for it.
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}
_TOP_LEVEL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_PART_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 frequency factors, folded into the config


def checkpoint_name(gguf_name: str) -> str:
    """The checkpoint name of a GGUF tensor name; ValueError for a tensor we cannot place."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_PART_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
    layer, part, kind = match.groups()
    return f"layers.{layer}.{_BLOCK_PART_NAMES[part]}.{kind}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of Q/K rows (weights or biases)."""
    rest = weight.shape[1:]
    half_head_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half_head_dim, 2, *rest).transpose(1, 2).reshape(weight.shape)


def tensor_bytes(tensor: ReaderTensor) -> torch.Tensor:
    """The raw bytes of a GGUF tensor, copied out of the memory map. # [num_bytes] uint8"""
    return torch.from_numpy(np.array(tensor.data, copy=True).view(np.uint8).reshape(-1))


def dequantize_tensor(tensor: ReaderTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A GGUF tensor as float32 in torch's dimension order (GGUF lists dimensions reversed)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return dequantize(tensor_bytes(tensor).to(device), tensor.tensor_type, shape)


class GGUFLoader:
    """`WeightLoader` for one `.gguf` file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        reader = GGUFReader(self.path)
        self.metadata: dict[str, Any] = {
            name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")
        }
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in reader.tensors}

    def load_config(self) -> ModelConfig:
        config = ModelConfig.from_gguf_metadata(self.metadata, self.tensors.keys())
        if _ROPE_FREQS in self.tensors:
            factors = dequantize_tensor(self.tensors[_ROPE_FREQS]).tolist()
            config = config.replace(
                rope_scaling={"rope_type": "freq_factors", "freq_factors": tuple(factors)}
            )
        return config

    def iter_weights(
        self, config: ModelConfig, device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        is_permuted = self.metadata["general.architecture"] == "llama"
        for gguf_name, tensor in self.tensors.items():
            if gguf_name == _ROPE_FREQS:
                continue
            name = checkpoint_name(gguf_name)
            weight = dequantize_tensor(tensor, device)
            if is_permuted and ".q_proj." in name:
                weight = unpermute_rows(weight, config.num_heads)
            elif is_permuted and ".k_proj." in name:
                weight = unpermute_rows(weight, config.num_kv_heads)
            yield name, weight

    def load_tokenizer(self) -> Tokenizer | None:
        if "tokenizer.ggml.tokens" not in self.metadata:
            return None
        eos_ids = ModelConfig.from_gguf_metadata(self.metadata, self.tensors.keys()).eos_token_ids
        return Tokenizer.from_gguf(self.path, self.metadata, eos_ids)

    def load_generation_config(self) -> dict[str, Any]:
        config = {}
        for key, hf_name in _SAMPLING_KEYS.items():
            value = self.metadata.get(f"general.sampling.{key}")
            if isinstance(value, float):  # stored as float32: 0.6 reads 0.6000000238...
                value = float(str(np.float32(value)))
            if value is not None:
                config[hf_name] = value
        return config
