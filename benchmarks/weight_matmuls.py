"""Weight formats for a decode step's matmuls on the CPU, side by side: what each costs per step
and how far it strays from float32 (the survey that picks issue 31's kernels).

    python -m benchmarks.weight_matmuls [--preset smollm2-135m] [--batches 1 4 32 64]

Every matmul of one model step of the preset runs on that layer's own weights, so a step
streams them from memory as the model does (one matrix reused would sit in the cache). Formats:

    fp32, bf16   kvpool's `Linear` today: oneDNN on weights packed at load
    int8         torch's `_weight_int8pack_mm`: int8 weights, one scale per output row,
                 bf16 activations
    int4-gG      torch's `_weight_int4pack_mm_for_cpu`: 4-bit weights packed for its kernel,
                 a scale and an offset per G input columns (GGUF's Q4_1 is G = 32), bf16
                 activations
    q4-gG, q8-gG kvpool's `quant_matmul`: 4- or 8-bit codes, a float16 scale and min per G
                 input columns, activations quantized to int8 per group (AVX-512 VNNI)

Printed per format and batch size: milliseconds per step (median of `--repeats` steps), the
weight bytes a step reads and so the bandwidth a batch-1 step reaches, and two errors: the
kernel's (its outputs against float32 on the weight the format holds, over the outputs' scale)
and the format's (that weight against the float32 one, over the largest weight).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from kvpool.kernels.group_quant import quantize
from kvpool.kernels.quant_matmul import pack, quant_matmul
from kvpool.model.config import ModelConfig
from kvpool.model.linear import Linear
from kvpool.model.presets import preset

MatMul = Callable[[torch.Tensor], torch.Tensor]


def step_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of every matmul in one step, layer by layer, then the LM head."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, ffn = config.hidden_size, config.intermediate_size
    layer = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * ffn), (ffn, hidden)]
    return layer * config.num_layers + [(hidden, config.vocab_size)]


def packed(weight: torch.Tensor, dtype: torch.dtype) -> MatMul:
    """kvpool's `Linear` over `weight` in `dtype`, packed for oneDNN."""
    linear = Linear(weight.shape[1], weight.shape[0], False, dtype, "cpu")
    linear.weight.data.copy_(weight)
    linear.pack()
    return lambda x: linear(x.to(dtype))


def int8_rows(weight: torch.Tensor) -> tuple[MatMul, torch.Tensor]:
    """int8 weights with one scale per output row; the matmul and the dequantized weight."""
    # The scales are rounded to bf16 (the kernel's) before the codes are chosen against them.
    scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127).to(torch.bfloat16)
    codes = torch.round(weight / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return (lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), codes, scales),
            codes.float() * scales.float()[:, None])


def int4_groups(weight: torch.Tensor, group: int, inner_k_tiles: int = 2
                ) -> tuple[MatMul, torch.Tensor]:
    """4-bit weights, a scale and an offset per `group` input columns (asymmetric, like
    GGUF's Q4_1); the matmul and the dequantized weight. torch's kernel reads a weight as
    `(code - 8) * scale + zero`, so `zero` is the group's minimum plus 8 scales."""
    rows, columns = weight.shape
    grouped = weight.reshape(rows, columns // group, group)
    low, high = grouped.amin(dim=2), grouped.amax(dim=2)
    scales = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, 15)
    scales, low = scales.to(torch.bfloat16), low.to(torch.bfloat16)
    zeros = low.float() + 8 * scales.float()
    dequantized = ((codes - 8) * scales.float()[..., None] + zeros[..., None]).reshape(rows,
                                                                                      columns)
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.reshape(rows, columns).to(torch.int32), inner_k_tiles)
    scales_and_zeros = torch.stack([scales.float(), zeros], dim=2).transpose(0, 1)
    scales_and_zeros = scales_and_zeros.contiguous().to(torch.bfloat16)
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), pack,
                                                                 group, scales_and_zeros),
            dequantized)


def kvpool_groups(weight: torch.Tensor, bits: int, group: int) -> tuple[MatMul, torch.Tensor]:
    """kvpool's own format and kernel; bf16 activations, as the model gives them."""
    quantized = quantize(weight, bits, group)
    packed_weight = pack(quantized)
    return (lambda x: quant_matmul(x.to(torch.bfloat16), packed_weight),
            quantized.dequantize())


def formats(groups: Sequence[int]) -> dict[str, Callable[[torch.Tensor], tuple[MatMul,
                                                                               torch.Tensor]]]:
    """Format name -> (weight -> (matmul, the weight it computes with))."""
    made = {"fp32": lambda w: (packed(w, torch.float32), w),
            "bf16": lambda w: (packed(w, torch.bfloat16), w.bfloat16().float()),
            "int8": int8_rows}
    for group in groups:
        made[f"int4-g{group}"] = lambda w, g=group: int4_groups(w, g)
    for bits in (4, 8):
        for group in groups:
            made[f"q{bits}-g{group}"] = lambda w, b=bits, g=group: kvpool_groups(w, b, g)
    return made


def weight_bytes(name: str, rows: int, columns: int) -> float:
    """Bytes of one [rows, columns] weight in format `name` (scales included)."""
    if name == "fp32":
        return 4 * rows * columns
    if name == "bf16":
        return 2 * rows * columns
    if name == "int8":
        return rows * columns + 2 * rows
    group = int(name.split("-g")[1])
    bits = 8 if name.startswith("q8") else 4
    return rows * columns * bits / 8 + 4 * rows * columns / group


def time_step(matmuls: list[tuple[MatMul, int]], inputs: dict[int, torch.Tensor],
              repeats: int) -> float:
    """Median milliseconds of one pass over every matmul (inputs by width)."""
    samples = []
    for _ in range(repeats + 1):  # the first pass lets oneDNN build its primitives
        start = time.perf_counter()
        for matmul, width in matmuls:
            matmul(inputs[width])
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[1:])


def error(matmul: MatMul, weight: torch.Tensor, x: torch.Tensor) -> float:
    """Largest |output - float32 output on the format's own weight|, over the output's scale:
    the kernel's error, not the quantization's."""
    reference = x @ weight.T
    return ((matmul(x).float() - reference).abs().max() / reference.abs().max()).item()


def run(config: ModelConfig, batches: Sequence[int], groups: Sequence[int], repeats: int,
        seed: int = 0, only: Sequence[str] | None = None) -> dict:
    generator = torch.Generator().manual_seed(seed)
    shapes = step_shapes(config)
    weights = [torch.randn(out, into, generator=generator) * 0.02 for into, out in shapes]
    report = {"shapes": len(shapes), "formats": {}}
    for name, make in formats(groups).items():
        if only and name not in only:
            continue
        built = [make(weight) for weight in weights]
        matmuls = [(matmul, weight.shape[1]) for (matmul, _), weight in zip(built, weights,
                                                                             strict=True)]
        step_bytes = sum(weight_bytes(name, *w.shape) for w in weights)
        row = {"step_mb": step_bytes / 1e6, "ms_per_step": {}, "max_rel_error": max(
            error(matmul, dequantized, torch.randn(4, w.shape[1], generator=generator))
            for (matmul, dequantized), w in zip(built[:5], weights[:5], strict=True)),
            "weight_error": max(((dequantized - w).abs().max() / w.abs().max()).item()
                                for (_, dequantized), w in zip(built[:5], weights[:5],
                                                               strict=True))}
        for batch in batches:
            inputs = {width: torch.randn(batch, width, generator=generator)
                      for width in {w.shape[1] for w in weights}}
            row["ms_per_step"][batch] = time_step(matmuls, inputs, repeats)
        row["batch1_gb_per_s"] = step_bytes / row["ms_per_step"][batches[0]] / 1e6
        report["formats"][name] = row
        print(f"{name:9s} {row['step_mb']:7.1f} MB/step  " + "  ".join(
            f"b{b}: {ms:7.2f} ms" for b, ms in row["ms_per_step"].items())
            + f"  b{batches[0]}: {row['batch1_gb_per_s']:5.1f} GB/s"
            f"  err {row['max_rel_error']:.1e}", file=sys.stderr, flush=True)
        del built, matmuls
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weight_matmuls",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32, 64])
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 64],
                        help="int4 group sizes (input columns per scale; they must divide every "
                        "input width: SmolLM2's 576 takes 32 and 64, not 128)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=None,
                        help="keep only this many layers of the preset (quick runs)")
    parser.add_argument("--formats", nargs="+", default=None, help="only these formats")
    args = parser.parse_args(argv)
    config = preset(args.preset)
    if args.layers is not None:
        config = config.replace(num_layers=args.layers, layers=config.layers[:args.layers])
    print(json.dumps(run(config, args.batches, args.groups, args.repeats, only=args.formats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
