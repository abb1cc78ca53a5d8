"""`quantization` (vLLM's option): which matmul weights stay quantized in memory, and how a
loaded model's weights are put into that form.

    None    vLLM's default, the checkpoint decides: a GGUF file's quantized tensors stay
            quantized ("gguf"), a float checkpoint loads in the model's dtype ("none")
    "gguf"  a GGUF's quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) stay
            as stored and are multiplied as they are; other quantized types are dequantized
            at load, with one warning naming them; float tensors stay float
    "int8", "int4"  every matmul weight (the LM head and embedding too, at 8 bits under
            int4) quantized at load from the float checkpoint: asymmetric, `group_size`
            weights a (scale, min)
    "none"  every weight dequantized into the model's dtype at load

Quantized weights run on the CPU (`kvpool.kernels.quant_matmul`); mixtures of experts keep
their experts in the model's dtype. `kvpool.model.quantized_weights` puts a loaded model's
weights in the chosen form. Light (no torch at import): the CLI's parser lists the choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

QUANTIZATION_CHOICES = ("gguf", "int8", "int4", "none")
_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class Quantization:
    """A resolved choice: `method` one of "gguf", "int8", "int4", "none"."""

    method: str = "none"
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES} or None, "
                             f"got {self.method!r}")
        if self.group_size < 8 or self.group_size % 8:
            raise ValueError(f"quantization_group_size must be a positive multiple of 8, got "
                             f"{self.group_size}")

    @property
    def keeps_gguf_blocks(self) -> bool:
        """Whether a GGUF loader yields its quantized tensors as they are stored."""
        return self.method == "gguf"

    @property
    def bits(self) -> int | None:
        """The bits of the codes quantized at load (int8/int4); None for the others."""
        return _BITS.get(self.method)


def resolve_quantization(requested: str | None, load_format: str, device: torch.device,
                         group_size: int = 32) -> Quantization:
    """The `Quantization` for a model in `load_format` ("gguf", "safetensors", "dummy") on
    `device`; ValueError for a choice that cannot apply there."""
    if requested is None:
        on_cpu = device.type == "cpu"
        return Quantization("gguf" if load_format == "gguf" and on_cpu else "none", group_size)
    choice = Quantization(requested, group_size)
    if choice.method == "gguf" and load_format != "gguf":
        raise ValueError(f"quantization='gguf' needs a GGUF file, not a {load_format} model")
    if choice.method != "none" and device.type != "cpu":
        raise ValueError(f"quantization={requested!r} runs on the CPU only (its kernels are "
                         f"CPU kernels), not on {device.type}: use quantization='none'")
    return choice

