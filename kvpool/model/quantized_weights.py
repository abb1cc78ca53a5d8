"""Putting a loaded model's matmul weights in the form `quantization` chose
(`kvpool.model.quantization`): GGUF blocks kept as stored, or float weights quantized to
int8/int4, each laid out for `kvpool.kernels.quant_matmul`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvpool.kernels.group_quant import GroupQuantized, concat_rows, quantize
from kvpool.kernels.quant_matmul import pack
from kvpool.model.quantization import Quantization

if TYPE_CHECKING:
    from kvpool.model.linear import Linear



def quantize_linears(sources: Sequence[tuple[Linear, Mapping[str, int]]],
                     targets: Mapping[str, torch.Tensor], staged: Mapping[str, GroupQuantized],
                     quantization: Quantization) -> None:
    """Put each layer of `sources` (`LlamaModel.linear_sources`) in `quantization`'s form,
    once its float parts are in `targets`: a layer whose every part is in `staged` (blocks a
    GGUF kept) holds them, stacked; any other staged part is dequantized into its target;
    int8/int4 then quantize every layer still float. A tied head is one layer: its table and
    the embedding lookup share the quantized rows."""
    kept = set()
    for linear, parts in sources:
        if all(name in staged for name in parts):
            linear.quantize(pack(concat_rows([staged[name] for name in parts])))
            kept.update(parts)
    for name, weight in staged.items():
        if name not in kept:
            targets[name].copy_(weight.dequantize())
    if quantization.bits is None:
        return
    for linear, parts in sources:
        if linear.quantized is None:
            linear.quantize(pack(_quantize_layer(linear, parts, quantization)))


# The embedding table and LM head keep 8 bits under int4, as llama.cpp's 4-bit mixes keep
# theirs at 6-8: at 4 bits they alone cost SmolLM2 several percent of perplexity.
_TABLE_NAMES = ("embed_tokens.weight", "lm_head.weight")


def _quantize_layer(linear: Linear, parts: Mapping[str, int],
                    quantization: Quantization) -> GroupQuantized:
    group = quantization.group_size
    bits = 8 if any(name in _TABLE_NAMES for name in parts) else quantization.bits
    if linear.in_features % group:
        raise ValueError(f"quantization_group_size {group} does not divide the "
                         f"{linear.in_features} input columns of {', '.join(parts)}: choose a "
                         "multiple of 8 that does (32 divides most models' widths)")
    return quantize(linear.weight, bits, group)
