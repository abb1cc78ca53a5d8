"""The `engine` step: kvpool's throughput on a dummy Llama-3-8B in bf16, and its decode step
against the bandwidth bound.

One engine serves every batch (1, 32, 64, 256): for each, a first untimed pass over prompts of
the same shapes (so Triton compiles and cuBLAS picks its kernels before anything is timed; other
prompts, so the timed pass gets no prefix-cache hits), then the timed pass. Each batch's record
is written as soon as it is measured. At batch 1 and 64 the same engine is timed again with its
decode CUDA graphs bypassed (`eager`: the steps `enforce_eager=True` runs), so the graphs'
gain is measured on one card, one set of weights. Then a seeded, sampled run checks that
sampling works on the device (`sampled`).

Per batch: `output_tok_per_s` = batch × output_len / wall time of the whole pass (prefill
included); `decode_step_ms` = median wall time of the steps in which every request gained a
token; `bound_ms` = (weight bytes + mean K/V bytes of a step) / the env step's read bandwidth.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, replace

from benchmarks.generation import Workload
from benchmarks.gpu.step import StepContext
from kvpool.engine.decode_graphs.runner import DecodeGraphRunner
from kvpool.engine.model_runner import ModelRunner

FULL = Workload(preset="llama-3-8b", batch=1, prompt_len=256, output_len=32, dtype="bfloat16")
FULL_BATCHES = (1, 32, 64, 256)
EAGER_BATCHES = (1, 64)  # also timed with the decode CUDA graphs bypassed
SMOKE = Workload(preset="tiny", batch=1, prompt_len=20, output_len=6, dtype="float32")
SMOKE_BATCHES = (1, 3)
FULL_KV_CACHE_BYTES = 32 << 30  # 256 sequences of 288 tokens need 9.7 GB in bf16
SMOKE_KV_CACHE_BYTES = 1 << 24


def run(ctx: StepContext, attention_backend: str = "auto") -> None:
    bandwidth = ctx.read_bandwidth()
    base, batches = (SMOKE, SMOKE_BATCHES) if ctx.smoke else (FULL, FULL_BATCHES)
    start = time.perf_counter()
    llm = build_llm(ctx, base, attention_backend)
    ctx.log.add("load", **asdict(base), load_s=time.perf_counter() - start,
                attention_backend=llm.engine.runner.model.attention_backend.name)
    for batch in batches:
        workload = replace(base, batch=batch)
        ctx.attempt("batch", lambda w=workload: measure(llm.engine, w, ctx.device, bandwidth),
                    **asdict(workload))
        if batch in EAGER_BATCHES and isinstance(llm.engine.runner, DecodeGraphRunner):
            ctx.attempt("eager", lambda w=workload: measure_eager(llm.engine, w, ctx.device,
                                                                  bandwidth), **asdict(workload))
    from benchmarks.generation import sampled_decoding_check

    ctx.attempt("sampled", lambda: sampled_decoding_check(llm, replace(base, batch=4)))


def build_llm(ctx: StepContext, workload: Workload, attention_backend: str):
    """One engine for every batch, its KV cache sized for the largest."""
    from kvpool import LLM

    if ctx.device.type == "cpu" and attention_backend == "auto":
        attention_backend = "torch"  # the CPU's C++ kernel would first be built: minutes
    return LLM(model=workload.preset, load_format="dummy", dtype=workload.dtype,
               device=str(ctx.device), attention_backend=attention_backend,
               seed=workload.seed, max_num_batched_tokens=8192,
               kv_cache_memory=SMOKE_KV_CACHE_BYTES if ctx.smoke else FULL_KV_CACHE_BYTES)


def measure_eager(engine, workload: Workload, device, bandwidth: float) -> dict:
    """`measure` with the engine's decode CUDA graphs bypassed: every step runs the plain
    `ModelRunner` path (what `enforce_eager=True` runs), on the same engine and weights."""
    runner = engine.runner
    runner.run_step = functools.partial(ModelRunner.run_step, runner)  # instance attribute
    try:
        return measure(engine, workload, device, bandwidth)
    finally:
        del runner.run_step


def measure(engine, workload: Workload, device, bandwidth: float) -> dict:
    """An untimed pass, then the timed one, of `workload.batch` prompts."""
    from benchmarks.generation import decode_bound, random_prompts, timed_greedy_run
    from kvpool.bench.roofline import weight_bytes_read_per_step

    config = engine.model_config
    warm = random_prompts(workload, config.vocab_size, offset=1)
    warm_s = timed_greedy_run(engine, warm, workload.output_len, device)["total_s"]
    prompts = random_prompts(workload, config.vocab_size)
    timing = timed_greedy_run(engine, prompts, workload.output_len, device)
    decode_steps = [s for s, n in timing.pop("steps") if n == workload.batch]
    decode_ms = statistics.median(decode_steps) * 1e3 if decode_steps else None
    weight_bytes = weight_bytes_read_per_step(config, engine.runner.model.dtype)
    bound = decode_bound(config, weight_bytes, workload, bandwidth)
    return {
        "untimed_pass_s": warm_s,
        **timing,
        "output_tok_per_s": workload.batch * workload.output_len / timing["total_s"],
        "num_decode_steps": len(decode_steps),
        "decode_step_ms": decode_ms,
        **bound,
        "read_bytes_per_s": bandwidth,
        "decode_step_over_bound": decode_ms / bound["bound_ms"] if decode_ms else None,
    }
