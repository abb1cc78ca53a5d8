"""`GroupQuantized`: a weight matrix stored as small unsigned integer codes, one (scale, min)
pair per group of consecutive weights along each row: the one logical form every quantized
weight takes between its source and the matmul kernel (`kvpool.kernels.quant_matmul` lays it
out for the kernel).

    w[n, k] = codes[n, k] * scales[n, k // group] + mins[n, k // group]

Every GGML block type kvpool keeps quantized maps onto this exactly, codes and all (a
symmetric type's min is -offset * scale: Q4_0's is -8 d, Q8_0's codes are q + 128 with min
-128 d); the K-quants' sub-block scales, d * sc, are rounded to float16 (relative error at most
2^-11, far below the step between two codes). kvpool's own int4/int8 (`quantize`) are
asymmetric: each group's range [min, max] is cut into 2^bits - 1 steps.

Invariants: codes are uint8 `[N, K]` with every value < 2^bits; scales and mins are float16
`[N, K / group]`; `group` divides K; bits is 4 or 8.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

BITS = (4, 8)


@dataclass(frozen=True)
class GroupQuantized:
    codes: torch.Tensor  # uint8 [N, K]
    scales: torch.Tensor  # float16 [N, K / group]
    mins: torch.Tensor  # float16 [N, K / group]
    bits: int

    def __post_init__(self) -> None:
        rows, cols = self.codes.shape
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, not {self.bits}")
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8, not {self.codes.dtype}")
        groups = self.scales.shape[-1]
        if (self.scales.shape != (rows, groups) or self.mins.shape != (rows, groups)
                or groups == 0 or cols % groups):
            raise ValueError(f"scales {tuple(self.scales.shape)} and mins "
                             f"{tuple(self.mins.shape)} do not divide codes {(rows, cols)} "
                             "into equal groups along each row")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights, computed in float32 then cast. # [N, K]"""
        rows, cols = self.shape
        grouped = self.codes.reshape(rows, -1, self.group).float()
        weights = grouped * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)
        return weights.reshape(rows, cols).to(dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GroupQuantized:
        """The same row operation (a permutation, a slice) on codes, scales and mins."""
        return GroupQuantized(fn(self.codes), fn(self.scales), fn(self.mins), self.bits)

    def narrow(self, dim: int, start: int, length: int) -> GroupQuantized:
        """Rows (dim 0) or whole groups of columns (dim 1) `[start, start + length)`, as
        `torch.Tensor.narrow`: what a tensor-parallel rank keeps."""
        if dim == 0:
            return self.map_rows(lambda t: t.narrow(0, start, length))
        if start % self.group or length % self.group:
            raise ValueError(f"columns [{start}, {start + length}) cut through groups of "
                             f"{self.group}")
        groups = slice(start // self.group, (start + length) // self.group)
        return GroupQuantized(self.codes[:, start:start + length], self.scales[:, groups],
                              self.mins[:, groups], self.bits)

    def split(self, sizes: Sequence[int], dim: int = 0) -> tuple[GroupQuantized, ...]:
        """Consecutive row blocks of `sizes` rows (a fused q/k/v into its parts)."""
        if dim != 0:
            raise ValueError("a GroupQuantized splits by rows only")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(0, start, size) for start, size in zip(starts, sizes,
                                                                          strict=True))

    def with_group(self, group: int) -> GroupQuantized:
        """Exactly the same weights in smaller groups (`group` divides this group)."""
        if self.group % group:
            raise ValueError(f"group {group} does not divide {self.group}")
        repeat = self.group // group
        return GroupQuantized(self.codes, self.scales.repeat_interleave(repeat, dim=1),
                              self.mins.repeat_interleave(repeat, dim=1), self.bits)

    def with_bits(self, bits: int) -> GroupQuantized:
        """Exactly the same weights with codes of `bits` (≥ these): the codes are kept."""
        if bits < self.bits:
            raise ValueError(f"cannot narrow {self.bits}-bit codes to {bits} bits exactly")
        return GroupQuantized(self.codes, self.scales, self.mins, bits)


def concat_rows(parts: Sequence[GroupQuantized]) -> GroupQuantized:
    """The parts stacked row-wise (a fused q/k/v or gate/up), exactly: the widest codes and
    the smallest group among them (each group must divide the others)."""
    bits = max(part.bits for part in parts)
    group = min(part.group for part in parts)
    same = [part.with_bits(bits).with_group(group) for part in parts]
    return GroupQuantized(torch.cat([part.codes for part in same]),
                          torch.cat([part.scales for part in same]),
                          torch.cat([part.mins for part in same]), bits)


def quantize(weight: torch.Tensor, bits: int, group: int) -> GroupQuantized:
    """Round-to-nearest asymmetric quantization of a float `[N, K]` matrix: each group's
    [min, max] in 2^bits - 1 equal steps (a group of equal weights gets scale 0)."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, not {bits}")
    rows, cols = weight.shape
    if cols % group:
        raise ValueError(f"group {group} does not divide the {cols} columns")
    grouped = weight.detach().float().reshape(rows, cols // group, group)
    low = grouped.amin(-1)
    high = grouped.amax(-1)
    # The float16 scale and min are what the kernel multiplies by: round first, code after.
    scales = ((high - low) / (2**bits - 1)).to(torch.float16)
    mins = low.to(torch.float16)
    step = scales.float().unsqueeze(-1)
    codes = ((grouped - mins.float().unsqueeze(-1)) / torch.where(step > 0, step, 1)).round()
    codes = codes.clamp_(0, 2**bits - 1).to(torch.uint8).reshape(rows, cols)
    return GroupQuantized(codes, scales, mins, bits)
