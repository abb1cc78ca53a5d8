"""Matmuls over group-quantized weights as they are stored: `PackedWeight` (a `GroupQuantized`
laid out for the kernels) and `quant_matmul`, which runs one of two C++ kernels on the CPU and
their PyTorch references elsewhere (the references are also the kernels' test oracles):

- below `DEQUANTIZED_FROM` tokens (decode), `csrc/quant_matmul.cpp`: the activations quantized
  per token and weight group in two int8 passes (scale = max|x| / 127, as llama.cpp's for its
  4- and 8-bit types; then each code's rounding error in 16ths of that step: ~12 bits, finer
  than bfloat16's 8) and multiplied as integers by the weights' codes with AVX-512 VNNI; the
  min term uses the exact float sum of each group of x. One int8 pass cost SmolLM2 +1.3%
  perplexity in bfloat16, two cost +0.05% (docs/cpu_decode.md);
- from `DEQUANTIZED_FROM` tokens (prefill), `csrc/dequant_matmul.cpp`: a tile of W at a time
  dequantized into x's dtype and multiplied by torch's GEMM, so that a compute-bound matmul
  runs at the float GEMM's speed with the dequantized model's accuracy.

Within a step, decode rows always take the integer kernel and only the prompt rows are
counted (`kvpool.kernels.decode_rows`): a row's result never depends on its neighbours.

`csrc/quant_layout.h` documents the layout: rows in panels of 16, each quad of k holding the
panel's 16 rows × 4 codes together, so one vector load feeds an AVX-512 VNNI multiply-add
whose lanes are output rows.

Measured here (SmolLM2-135M's 121 matmuls a step, `python -m benchmarks.weight_matmuls`):
docs/cpu_decode.md.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpool.kernels.cpu_kernels import cpu_kernels_available
from kvpool.kernels.decode_rows import current_decode_rows
from kvpool.kernels.group_quant import GroupQuantized

PANEL = 16  # output rows a panel
RESIDUAL_STEPS = 16  # an activation is (code + residual / 16) steps of its group's scale
MAX_GROUP = 512  # keeps the kernel's integer sums (16 · Σ code · x code) well within int32
# Tokens from which a matmul dequantizes tiles instead: SmolLM2's 121 step matmuls on this
# 2-core machine with bf16 activations took 54.6 ms (integer kernel) against 69.5 (dequantizing)
# at 64 tokens, 110 against 114 at 128, 230 against 204 at 256 and 503 against 403 at 512.
# `KVPOOL_DEQUANTIZED_FROM=N` moves the switch, to measure one kernel alone (a huge N keeps every
# matmul, prefill included, on the integer kernel: docs/cpu_decode.md's accuracy table).
DEFAULT_DEQUANTIZED_FROM = 128


def _dequantized_from() -> int:
    value = os.environ.get("KVPOOL_DEQUANTIZED_FROM", str(DEFAULT_DEQUANTIZED_FROM))
    if not value.isdigit():
        raise ValueError(f"KVPOOL_DEQUANTIZED_FROM must be a number of tokens, not {value!r}")
    return int(value)


DEQUANTIZED_FROM = _dequantized_from()
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PackedWeight:
    """A `GroupQuantized` `[rows, cols]` in the kernel's layout: rows padded to panels of 16,
    each panel one run of blocks, one a group (its codes, then 16 float16 scales and mins)."""

    data: torch.Tensor  # uint8 [panels, groups, block_bytes], flattened
    bits: int
    group: int
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def code_bytes(self) -> int:
        """A block's codes: 16 rows × `group` codes of `bits`."""
        return self.group * PANEL * self.bits // 8

    def blocks(self) -> torch.Tensor:
        """# [panels, groups, code_bytes + 64] uint8"""
        return self.data.view(-1, self.cols // self.group, self.code_bytes + 4 * PANEL)


def pack(weight: GroupQuantized) -> PackedWeight:
    """Lay `weight` out for the kernel. Its group must be a multiple of 8."""
    rows, cols = weight.shape
    if weight.group % 8 or weight.group > MAX_GROUP:
        raise ValueError(f"the kernel takes groups that are multiples of 8 up to {MAX_GROUP}, "
                         f"not {weight.group}")
    padding = -rows % PANEL
    codes, scales, mins = (F.pad(t, (0, 0, 0, padding)) for t in
                           (weight.codes, weight.scales, weight.mins))
    panels, groups = codes.shape[0] // PANEL, cols // weight.group
    # [panel, 16 rows, k/4, 4] -> [panel, k/4, 16 rows, 4]: a quad's 16 rows × 4 codes together.
    quads = codes.reshape(panels, PANEL, cols // 4, 4).transpose(1, 2)
    if weight.bits == 4:  # quads 2i and 2i + 1 share bytes: low nibble, high nibble
        pairs = quads.reshape(panels, cols // 8, 2, PANEL * 4)
        quads = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    blocks = [quads.reshape(panels, groups, -1),
              *(_panel_major(t, panels).view(torch.uint8) for t in (scales, mins))]
    return PackedWeight(torch.cat(blocks, dim=2).reshape(-1), weight.bits, weight.group, rows,
                        cols)


def _panel_major(per_row: torch.Tensor, panels: int) -> torch.Tensor:
    """[rows, groups] -> [panels, groups, 16]."""
    return per_row.reshape(panels, PANEL, -1).transpose(1, 2).contiguous()


def unpack(weight: PackedWeight, rows: torch.Tensor | None = None) -> GroupQuantized:
    """The `GroupQuantized` of `weight`, or of only the given `rows` (an embedding lookup)."""
    rows = torch.arange(weight.rows) if rows is None else rows
    panel, lane = rows // PANEL, rows % PANEL
    blocks = weight.blocks()[panel]  # [n, groups, block_bytes]
    chunks = blocks[..., :weight.code_bytes].reshape(len(rows), -1, PANEL, 4)
    codes = chunks[torch.arange(len(rows)), :, lane]  # [n, chunks of 4 k, 4]: each row's lane
    if weight.bits == 4:  # [n, k/8, 4] bytes -> [n, k/8, 2 quads, 4]
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=2)
    halves = blocks[..., weight.code_bytes:].contiguous().view(torch.float16)  # [n, groups, 32]
    index = lane.view(-1, 1, 1).expand(-1, halves.shape[1], 1)
    scales = halves[..., :PANEL].gather(2, index).squeeze(2)
    mins = halves[..., PANEL:].gather(2, index).squeeze(2)
    return GroupQuantized(codes.reshape(len(rows), weight.cols), scales, mins, weight.bits)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """The kernel's activation quantization: per token and group, scale = max|x| / 127; codes
    round(x / scale) and residuals round((x / scale - code) · 16), ties to even; and the exact
    sum of the group. # codes [M, K] float32 (integers), residuals [M, K] (integers in [-8, 8]),
    scales [M, K/G], sums [M, K/G]"""
    grouped = x.float().reshape(x.shape[0], -1, group)
    scales = grouped.abs().amax(-1) / 127
    inverse = torch.where(scales > 0, 1 / scales, 0).unsqueeze(-1)
    scaled = grouped * inverse
    codes = torch.round(scaled)
    residuals = torch.round((scaled - codes) * RESIDUAL_STEPS)
    return codes.reshape(x.shape), residuals.reshape(x.shape), scales, grouped.sum(-1)


def quant_matmul_reference(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """What the kernel computes, in PyTorch (float64 sums; the kernel's float32 ones differ in
    rounding only). # [M, K] -> [M, rows], x's dtype"""
    plain = unpack(weight)
    codes, residuals, x_scales, x_sums = (t.double() for t in
                                          quantize_activations(x, weight.group))
    x_steps = codes * RESIDUAL_STEPS + residuals  # the activations in 16ths of their step
    groups = weight.cols // weight.group
    w_codes = plain.codes.double().reshape(weight.rows, groups, weight.group)
    dots = torch.einsum("mgk,ngk->mng", x_steps.reshape(x.shape[0], groups, -1), w_codes)
    scaled = dots * plain.scales.double() * (x_scales / RESIDUAL_STEPS).unsqueeze(1)
    shifted = plain.mins.double() * x_sums.unsqueeze(1)
    return (scaled + shifted).sum(-1).to(x.dtype)


@functools.cache
def _kernels_loaded() -> bool:
    return cpu_kernels_available()


def is_served(x: torch.Tensor) -> bool:
    """Whether the C++ kernel takes activations `x` (CPU, float32 or bfloat16, kernels built)."""
    return x.device.type == "cpu" and x.dtype in _ACTIVATION_DTYPES and _kernels_loaded()


def dequant_matmul_reference(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """What the dequantizing kernel computes: x times W dequantized into x's dtype. # [M, K] ->
    [M, rows], x's dtype"""
    return x @ unpack(weight).dequantize().to(x.dtype).T


def dequantizes(num_tokens: int) -> bool:
    """Whether a matmul of `num_tokens` tokens takes the dequantizing kernel."""
    return num_tokens >= DEQUANTIZED_FROM


def quant_matmul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x Wᵀ for `x` `[M, cols]` (any leading dimensions flattened). # [..., rows]

    A step's decode rows (`kvpool.kernels.decode_rows`) always take the integer kernel, and
    its prompt rows the kernel their own count picks, so no row's result depends on what else
    shares the step."""
    flat = x.reshape(-1, weight.cols)
    num_rows = flat.shape[0]
    if not dequantizes(num_rows):  # no part could dequantize: one integer kernel for all
        return _matmul(flat, weight, dequantize=False).reshape(*x.shape[:-1], weight.rows)
    decodes = current_decode_rows()
    if isinstance(decodes, int):  # the first `decodes` rows
        decodes = min(decodes, num_rows)
        if not dequantizes(num_rows - decodes):
            out = _matmul(flat, weight, dequantize=False)
        elif decodes == 0:
            out = _matmul(flat, weight, dequantize=True)
        else:
            out = torch.cat((_matmul(flat[:decodes], weight, dequantize=False),
                             _matmul(flat[decodes:], weight, dequantize=True)))
    else:  # a mask of decode rows among others
        out = _split_by_mask(flat, weight, decodes)
    return out.reshape(*x.shape[:-1], weight.rows)


def _split_by_mask(flat: torch.Tensor, weight: PackedWeight, is_decode: torch.Tensor
                   ) -> torch.Tensor:
    prompts = ~is_decode
    if not dequantizes(int(prompts.sum())):
        return _matmul(flat, weight, dequantize=False)
    if not bool(is_decode.any()):
        return _matmul(flat, weight, dequantize=True)
    out = flat.new_empty(flat.shape[0], weight.rows)
    out[is_decode] = _matmul(flat[is_decode], weight, dequantize=False)
    out[prompts] = _matmul(flat[prompts], weight, dequantize=True)
    return out


def _matmul(flat: torch.Tensor, weight: PackedWeight, dequantize: bool) -> torch.Tensor:
    if is_served(flat):
        kernel = (torch.ops.kvpool_cpu.dequant_matmul if dequantize
                  else torch.ops.kvpool_cpu.quant_matmul)
        return kernel(flat.contiguous(), weight.data, weight.bits, weight.group, weight.rows)
    reference = dequant_matmul_reference if dequantize else quant_matmul_reference
    return reference(flat, weight)
