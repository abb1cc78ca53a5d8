"""Weights, config and tokenizer from a GGUF file (llama.cpp's format), read with `gguf`.

The file is parsed once; its key-values give the config and tokenizer, its tensors are
dequantized one at a time (see `dequant`) on the target device. GGUF names map to checkpoint
names (`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`).

Why Q/K rows are permuted back: llama.cpp's converter reorders each head's Q and K rows from
HuggingFace's rotate-half layout (dimension i pairs with i + head_dim/2) to interleaved pairs
(2i with 2i+1), which its rotary kernel expects. Our rotary embedding uses the rotate-half layout,
so for `llama` files the rows are put back. Qwen2 files are written without the reordering.

Phi-3 (`phi3`) keeps its checkpoints' fused projections: `attn_qkv` is `qkv_proj` and `ffn_up`
holds the gate's rows, then the up's (`gate_up_proj`); the model splits both as it loads them
(`kvpool.model.fused_weights`), so under tensor parallelism they are read whole. Its LongRoPE
factor tensors go into the config, not the model. Its Q/K rows are not reordered.

Mixtures of experts: GGUF stacks a layer's experts, `ffn_{gate,up}_exps` [E, I, H] and
`ffn_down_exps` [E, H, I], beside the router `ffn_gate_inp` [E, H]. The model takes the Hub's
per-expert names (Qwen3-MoE `mlp.experts.{e}.gate_proj`, Mixtral `block_sparse_moe.experts.{e}.w1`,
...: `MoEConfig.names`), so each stacked tensor is read once and yielded as E views.

Tensor parallelism: a rank reads only its slice of each tensor, cut from the raw quantized
bytes before dequantizing (`read_slice`). The reordering is within each head, so whole heads
are cut first and then put back with the local head count. A stacked expert tensor is cut the
same way in every expert at once (each rank holds every expert, a slice of its width).

Sampling defaults: llama.cpp's converter copies a model's generation_config.json into
`general.sampling.*` keys; `load_generation_config` gives them back under HF's names.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor

from kvpool.kernels.group_quant import GroupQuantized
from kvpool.model.config import ModelConfig
from kvpool.model.gguf_config import PHI3_LONG_FACTORS, PHI3_SHORT_FACTORS, config_from_gguf
from kvpool.model.layer_spec import ExpertNames, MoEConfig
from kvpool.model.loaders.dequant import dequantize
from kvpool.model.loaders.gguf_blocks import KEPT_TYPES, to_group_quantized
from kvpool.model.parallel import ShardSlice, TensorParallel, take_slice
from kvpool.model.shard_slices import shard_slice
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
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v rows in one tensor
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's norms on both sides of each sublayer: `ffn_norm` is the MLP's input norm there too.
_SANDWICH_PART_NAMES = {
    **_BLOCK_PART_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Stacked experts [E, ...] -> the `ExpertNames` field of each expert's projection.
_EXPERT_STACKS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_ROUTER = "ffn_gate_inp"
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 frequency factors, folded into the config
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                GGMLQuantizationType.F64)
_CONFIG_TENSORS = (_ROPE_FREQS, PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS)  # not the model's


def checkpoint_name(gguf_name: str, sandwich_norms: bool = False,
                    experts: ExpertNames | None = None, fused_up: bool = False) -> str:
    """The checkpoint name of a GGUF tensor name (`sandwich_norms`: Gemma's norm names;
    `experts`: the names of a model with experts, for its router; `fused_up`: `ffn_up` holds
    gate and up, Phi-3's `gate_up_proj`); ValueError for a tensor we cannot place (stacked
    experts: see `expert_names`)."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    parts = _SANDWICH_PART_NAMES if sandwich_norms else _BLOCK_PART_NAMES
    if experts is not None:
        parts = {**parts, _ROUTER: f"{experts.block}.gate"}
    if fused_up:
        parts = {**parts, "ffn_up": "mlp.gate_up_proj"}
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in parts:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
    layer, part, kind = match.groups()
    return f"layers.{layer}.{parts[part]}.{kind}"


def expert_names(gguf_name: str, moe: MoEConfig | None) -> list[str] | None:
    """The per-expert checkpoint names of a stacked GGUF expert tensor, expert 0 first
    (`blk.3.ffn_up_exps.weight` -> `layers.3.mlp.experts.{e}.up_proj.weight`); None for any
    other tensor, and for every tensor of a model without experts."""
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if moe is None or match is None or match.group(2) not in _EXPERT_STACKS:
        return None
    layer, part, kind = match.groups()
    names = moe.names
    projection = getattr(names, _EXPERT_STACKS[part])
    return [f"layers.{layer}.{names.block}.experts.{expert_id}.{projection}.{kind}"
            for expert_id in range(moe.num_experts)]


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of Q/K rows (weights or biases)."""
    rest = weight.shape[1:]
    half_head_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half_head_dim, 2, *rest).transpose(1, 2).reshape(weight.shape)


def tensor_bytes(tensor: ReaderTensor) -> torch.Tensor:
    """The raw bytes of a GGUF tensor, copied out of the memory map. # [num_bytes] uint8"""
    return torch.from_numpy(np.array(tensor.data, copy=True).view(np.uint8).reshape(-1))


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions reversed


def dequantize_tensor(tensor: ReaderTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A GGUF tensor as float32 in torch's dimension order."""
    return dequantize(tensor_bytes(tensor).to(device), tensor.tensor_type, torch_shape(tensor))


def read_slice(
    tensor: ReaderTensor, spec: ShardSlice, device: torch.device | str = "cpu",
    keep_quantized: bool = False,
) -> torch.Tensor | GroupQuantized:
    """The part `spec` names of a GGUF tensor (any number of dimensions), as float32, copying
    and dequantizing only that part's blocks where it can; with `keep_quantized`, a matrix of
    a type `gguf_blocks` keeps comes as its `GroupQuantized` instead.

    Each row (the last dimension) is a run of quantization blocks, so a range along any other
    dimension is a range of whole block runs, and a range of columns is a range of blocks
    within every row when both its ends fall on block boundaries. A column range that cuts
    through a block cannot be taken from the raw bytes: the whole tensor is dequantized, then
    sliced.
    """
    raw, shape = _raw_part(tensor, spec)
    if raw is None:  # not block-aligned
        return take_slice(dequantize_tensor(tensor, device), spec)
    raw = raw.to(device)
    if keep_quantized and len(shape) == 2 and tensor.tensor_type in KEPT_TYPES:
        try:
            return to_group_quantized(raw, tensor.tensor_type, shape)
        except ValueError:  # a scale past float16's range: such a tensor stays float
            pass
    return dequantize(raw, tensor.tensor_type, shape)


def _raw_part(tensor: ReaderTensor, spec: ShardSlice) -> tuple[torch.Tensor | None, tuple]:
    """The raw bytes of the part `spec` names and its shape; None for the bytes where a
    column range cuts through a block."""
    shape = torch_shape(tensor)
    if spec is None:
        return tensor_bytes(tensor), shape
    block_numel, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    dim, span = spec
    # A view of the memory map: nothing is copied until the slice is taken.
    blocks = np.asarray(tensor.data).view(np.uint8).reshape(
        *shape[:-1], shape[-1] // block_numel, block_bytes)
    is_column = dim == len(shape) - 1
    if is_column and (span.start % block_numel or span.stop % block_numel):
        return None, shape
    index = [slice(None)] * len(shape)
    index[dim] = slice(span.start // block_numel, span.stop // block_numel) if is_column else span
    part = blocks[tuple(index)]
    raw = torch.from_numpy(np.array(part, copy=True).reshape(-1))  # out of the map
    part_shape = list(shape)
    part_shape[dim] = span.stop - span.start
    return raw, tuple(part_shape)


class GGUFLoader:
    """`WeightLoader` for one `.gguf` file. With `keep_quantized` (`quantization="gguf"`) its
    quantized matrices of the types `gguf_blocks` keeps come as `GroupQuantized`; other
    quantized types are dequantized, with one warning naming them."""

    def __init__(self, path: str | Path, keep_quantized: bool = False) -> None:
        self.path = Path(path)
        self.keep_quantized = keep_quantized
        reader = GGUFReader(self.path)
        self.metadata: dict[str, Any] = {
            name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")
        }
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in reader.tensors}

    def load_config(self) -> ModelConfig:
        rope_factors = {name: dequantize_tensor(self.tensors[name]).tolist()
                        for name in (PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS)
                        if name in self.tensors}
        config = config_from_gguf(self.metadata, self.tensors.keys(), rope_factors)
        if _ROPE_FREQS in self.tensors:
            factors = dequantize_tensor(self.tensors[_ROPE_FREQS]).tolist()
            config = config.replace(
                rope_scaling={"rope_type": "freq_factors", "freq_factors": tuple(factors)}
            )
        return config

    def iter_weights(
        self, config: ModelConfig, device: torch.device,
        tp: TensorParallel = TensorParallel.single(),  # noqa: B008 (frozen, immutable)
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # llama.cpp's converter permutes Q/K rows for Llama and the models it converts as
        # Llama (SmolLM3), not for Qwen2/Qwen3.
        arch = self.metadata["general.architecture"]
        is_permuted = arch in ("llama", "smollm3")
        if self.keep_quantized:
            self._warn_dequantized_types()
        for gguf_name, tensor in self.tensors.items():
            if gguf_name in _CONFIG_TENSORS:
                continue
            experts = expert_names(gguf_name, config.moe)
            if experts is not None:
                yield from zip(experts, self._read_experts(tensor, config, tp, experts, device),
                               strict=True)
                continue
            names = config.moe.names if config.moe is not None else None
            name = checkpoint_name(gguf_name, config.sandwich_norms, names, arch == "phi3")
            weight = read_slice(tensor, shard_slice(config, tp, name), device,
                                self.keep_quantized)
            if is_permuted and (".q_proj." in name or ".k_proj." in name):
                # Whole heads were read: put back each of the local ones.
                heads = weight.shape[0] // config.head_dim
                weight = (weight.map_rows(lambda rows, n=heads: unpermute_rows(rows, n))
                          if isinstance(weight, GroupQuantized) else unpermute_rows(weight, heads))
            yield name, weight

    def _warn_dequantized_types(self) -> None:
        """One warning naming the quantized types this file holds that stay float."""
        dropped = sorted({t.tensor_type.name for t in self.tensors.values()
                          if t.tensor_type not in (*KEPT_TYPES, *_FLOAT_TYPES)})
        if dropped:
            warnings.warn(f"{self.path.name}: {', '.join(dropped)} tensors are dequantized at "
                          f"load (kept quantized: "
                          f"{', '.join(sorted(t.name for t in KEPT_TYPES))})", stacklevel=3)

    @staticmethod
    def _read_experts(tensor: ReaderTensor, config: ModelConfig, tp: TensorParallel,
                      names: list[str], device: torch.device) -> tuple[torch.Tensor, ...]:
        """A stacked expert tensor as one view per expert, each this rank's slice: every
        expert takes the same part of its own tensor, one dimension further in the stack."""
        spec = shard_slice(config, tp, names[0])
        stacked_spec = None if spec is None else (spec[0] + 1, spec[1])
        return read_slice(tensor, stacked_spec, device).unbind(0)

    def load_tokenizer(self) -> Tokenizer | None:
        if "tokenizer.ggml.tokens" not in self.metadata:
            return None
        eos_ids = self.load_config().eos_token_ids
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
