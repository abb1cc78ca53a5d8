"""The `e2e` step: greedy generation on the GPU against the CPU, over the very same weights.

The dummy loader draws its weights with a generator on the target device, and CUDA's and the
CPU's generators give different numbers. So the weights are drawn once, on the CPU, written as
a HuggingFace directory (`config.json` + `model.safetensors`, float32) and every run loads that
directory: the CPU fp32 run with the torch attention backend is the reference, and each GPU
variant's greedy tokens are compared with it position by position.

fp32 variants must give identical tokens (same weights, same arithmetic up to summation order;
TF32 is off by default in PyTorch). bf16 weights and int8 / fp8 KV caches round differently, so
they need only be close: at least `CLOSE_MIN_MATCH` of the token positions equal the
reference's. Each variant's record gives its match fraction and, per prompt, the first position
that differs (None where none does).

A smoke run on a machine without CUDA runs the "device" variants on the CPU, the Triton ones in
Triton's interpreter, which does no bfloat16 arithmetic (Triton's documented limit: it computes
on the bit patterns), so there the bf16 variant uses the torch backend.
"""

from __future__ import annotations

import gc
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.gpu.step import StepContext

FULL_PRESET = "smollm2-135m"  # GQA 9:3, head_dim 64, 30 layers: small, but every code path
SMOKE_PRESET = "tiny"
OUTPUT_LEN = 16
SMOKE_OUTPUT_LEN = 4
CLOSE_MIN_MATCH = 0.75


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: str
    attention_backend: str
    kv_cache_dtype: str = "auto"
    on_cpu: bool = False

    @property
    def is_exact(self) -> bool:
        """fp32 all the way: tokens must equal the reference's."""
        return self.dtype == "float32" and self.kv_cache_dtype == "auto"


REFERENCE = Variant("cpu_fp32_torch", "float32", "torch", on_cpu=True)
DEVICE_VARIANTS = (
    Variant("fp32_torch", "float32", "torch"),
    Variant("fp32_triton", "float32", "triton"),
    Variant("bf16_triton", "bfloat16", "triton"),
    Variant("fp32_int8_kv_triton", "float32", "triton", kv_cache_dtype="int8"),
    Variant("fp32_fp8_kv_triton", "float32", "triton", kv_cache_dtype="fp8_e4m3"),
)
INTERPRETED_BF16 = Variant("bf16_torch", "bfloat16", "torch")  # the interpreter has no bf16


def device_variants(is_interpreted: bool) -> tuple[Variant, ...]:
    """The variants compared with the reference; bf16 leaves Triton in its interpreter."""
    if not is_interpreted:
        return DEVICE_VARIANTS
    return tuple(INTERPRETED_BF16 if v.name == "bf16_triton" else v for v in DEVICE_VARIANTS)


def prompts() -> list[dict]:
    """Two prompts sharing a 40-token prefix (prefix caching), a 3-token one and a 150-token
    one; with 64 tokens a step, chunked prefills mix with decodes."""
    shared = [(7 * i) % 500 + 1 for i in range(40)]
    return [
        {"prompt_token_ids": [*shared, 11, 12, 13]},
        {"prompt_token_ids": [*shared, 21]},
        {"prompt_token_ids": [5, 6, 7]},
        {"prompt_token_ids": [(13 * i) % 500 + 1 for i in range(150)]},
    ]


def run(ctx: StepContext) -> None:
    preset = SMOKE_PRESET if ctx.smoke else FULL_PRESET
    output_len = SMOKE_OUTPUT_LEN if ctx.smoke else OUTPUT_LEN
    device = str(ctx.device)
    with tempfile.TemporaryDirectory(prefix="gpu_check_weights_") as directory:
        weights = Path(directory)
        ctx.log.add("weights", preset=preset, output_len=output_len,
                    **write_cpu_weights(preset, weights))
        reference = ctx.log.add("reference", **asdict(REFERENCE),
                                token_ids=greedy_tokens(weights, REFERENCE, output_len))
        for variant in device_variants(is_interpreted=device == "cpu"):
            ctx.attempt("variant", lambda v=variant: _compared(weights, v, output_len, reference),
                        **asdict(variant), device=device)


def write_cpu_weights(preset: str, directory: Path) -> dict:
    """The dummy loader's weights for `preset`, drawn on the CPU, as a HuggingFace directory."""
    import torch
    from safetensors.torch import save_file

    from kvpool.model import presets
    from kvpool.model.hf_config import plain_hf_config
    from kvpool.model.loaders.dummy import DummyLoader

    config = presets.preset(preset)
    cpu = torch.device("cpu")
    tensors = {f"model.{name}" if name != "lm_head.weight" else name: t.float().contiguous()
               for name, t in DummyLoader(config).iter_weights(config, cpu)}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(plain_hf_config(config), indent=1))
    return {"num_tensors": len(tensors), "num_bytes": sum(t.nbytes for t in tensors.values())}


def greedy_tokens(weights: Path, variant: Variant, output_len: int) -> list[list[int]]:
    """Greedy continuations of `prompts()` (EOS ignored) with `variant`'s settings, on the
    CPU or the GPU (when there is one) as the variant says."""
    import torch

    from kvpool import LLM, SamplingParams

    device = "cuda" if torch.cuda.is_available() and not variant.on_cpu else "cpu"
    llm = LLM(model=str(weights), load_format="safetensors", device=device,
              dtype=variant.dtype, attention_backend=variant.attention_backend,
              kv_cache_dtype=variant.kv_cache_dtype, kv_cache_memory=1 << 26,
              max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    del llm
    _release_memory()
    return [list(output.outputs[0].token_ids) for output in outputs]


def compare(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    """Position-by-position agreement with the reference: the fraction of equal positions and,
    per prompt, the first position that differs (None where none does)."""
    pairs = [list(zip(ref, got, strict=True)) for ref, got in zip(reference, tokens, strict=True)]
    num_equal = sum(a == b for row in pairs for a, b in row)
    first = [next((i for i, (a, b) in enumerate(row) if a != b), None) for row in pairs]
    return {"match_fraction": num_equal / max(1, sum(len(row) for row in pairs)),
            "first_divergence": first, "identical": tokens == reference}


def verdict(variant: Variant, comparison: dict) -> dict:
    """Whether `variant` passes: identical tokens when exact, else enough equal positions."""
    if variant.is_exact:
        return {"required": "identical", "passed": comparison["identical"]}
    return {"required": f"match_fraction >= {CLOSE_MIN_MATCH}",
            "passed": comparison["match_fraction"] >= CLOSE_MIN_MATCH}


def _compared(weights: Path, variant: Variant, output_len: int, reference: dict) -> dict:
    tokens = greedy_tokens(weights, variant, output_len)
    comparison = compare(reference["token_ids"], tokens)
    return {**comparison, **verdict(variant, comparison), "token_ids": tokens}


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
