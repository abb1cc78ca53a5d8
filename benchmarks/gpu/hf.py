"""The `hf` step: transformers `generate` on the engine step's weights and batches.

`LlamaForCausalLM` (its default attention, SDPA) holds the dummy loader's weights drawn on the
same device with the same seed, so the very same numbers as the engine's. Per batch: one
warm-up `generate` of two tokens, a prefill-only run and the full run; `decode_step_ms` =
(full − prefill-only) / (output_len − 1), `output_tok_per_s` = batch × output_len / full run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

from benchmarks.gpu.engine import FULL, FULL_BATCHES, SMOKE, SMOKE_BATCHES
from benchmarks.gpu.step import StepContext


def run(ctx: StepContext) -> None:
    import torch
    import transformers

    from benchmarks.generation import load_dummy_hf_model

    base, batches = (SMOKE, SMOKE_BATCHES) if ctx.smoke else (FULL, FULL_BATCHES)
    start = time.perf_counter()
    model = load_dummy_hf_model(base.preset, getattr(torch, base.dtype), base.seed, ctx.device)
    ctx.log.add("load", **asdict(base), load_s=time.perf_counter() - start,
                transformers_version=transformers.__version__,
                attn_implementation=model.config._attn_implementation)
    for batch in batches:
        workload = replace(base, batch=batch)
        ctx.attempt("batch", lambda w=workload: measure(model, w, ctx.device),
                    **asdict(workload))


def measure(model, workload, device) -> dict:
    from benchmarks.generation import hf_generate_run, random_prompts

    prompts = random_prompts(workload, model.config.vocab_size)
    hf_generate_run(model, prompts, 2, device)  # warm-up: kernels chosen, caches allocated
    return hf_generate_run(model, prompts, workload.output_len, device)
