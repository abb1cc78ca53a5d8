"""How much of the machine a run uses: the model FLOPs a workload needs, the weight bytes a
decode step reads, and the matmul peak.

Model FLOPs count what the workload needs, not what an engine happens to do: every token fed
to the model (each prompt token and each generated token but the last) passes through every
layer's projections (2 FLOPs per weight), attends to itself and every token before it (QKᵀ and
PV: 4 × heads × head_dim FLOPs per key), and every generated token needs one row of the LM
head. Prompt tokens served from the prefix cache are not counted (no engine computes them), nor
is recomputation after preemption (work an engine chose to redo).

The peak is a large square `torch.mm` in the run's dtype, measured on the same machine in the
same run (the figure a matmul-bound engine could reach; small-M matmuls reach less).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from kvpool.model.config import ModelConfig
from kvpool.model.flops import key_flops, token_flops

PEAK_MATMUL_SIZE = 2048  # M = N = K of the peak measurement, where the dtype is fast
PEAK_PROBE_SIZE = 256  # the probe that tells how long a PEAK_MATMUL_SIZE call would take
PEAK_CALL_BUDGET_S = 0.25  # the longest one timed call may take


def workload_flops(config: ModelConfig, requests: Sequence[tuple[int, int]],
                   cached_tokens: Sequence[int] | None = None) -> float:
    """FLOPs of generating `requests`, each (prompt length, output length), when each
    request's first `cached_tokens` prompt tokens come from the prefix cache (default none)."""
    per_token, per_key = token_flops(config), key_flops(config)
    lm_head_row = 2 * config.vocab_size * config.hidden_size
    cached_tokens = cached_tokens or [0] * len(requests)
    total = 0.0
    for (prompt_len, output_len), cached in zip(requests, cached_tokens, strict=True):
        fed = prompt_len + output_len - 1  # the last generated token is never fed back
        # The token at position p attends to p + 1 keys; positions below `cached` are skipped.
        keys = fed * (fed + 1) // 2 - cached * (cached + 1) // 2
        total += (fed - cached) * per_token + keys * per_key + output_len * lm_head_row
    return total


def weight_bytes_read_per_step(model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads (its bandwidth floor): every weight but the
    token-embedding table (read only for the batch's rows), unless the table is also the
    language-model head."""
    from kvpool.model.llama import checkpoint_shapes

    element_size = torch.empty((), dtype=dtype).element_size()
    return sum(
        math.prod(shape) * element_size
        for name, shape in checkpoint_shapes(model_config).items()
        if name != "embed_tokens.weight" or model_config.tie_word_embeddings
    )


def matmul_peak_flops(dtype: torch.dtype, repeats: int = 5,
                      call_budget_s: float = PEAK_CALL_BUDGET_S) -> float:
    """Best FLOP/s of a square `torch.mm` on the CPU in `dtype` over `repeats` timed calls.

    The matrices are PEAK_MATMUL_SIZE square unless one such call would take longer than
    `call_budget_s` (a dtype the CPU has no fast path for: bfloat16 without AVX-512 BF16 runs
    ~50x slower than float32), judged from a small probe; then the size is cut so a call
    stays within budget: the figure is as slow as the dtype, but the measurement is not."""
    generator = torch.Generator().manual_seed(0)
    probe = PEAK_PROBE_SIZE
    seconds = _best_mm_seconds(probe, dtype, generator, repeats=1)
    scale = (call_budget_s / max(seconds, 1e-9)) ** (1 / 3)  # an mm costs size**3
    size = max(probe, min(PEAK_MATMUL_SIZE, int(probe * scale) // 64 * 64))
    return 2 * size**3 / _best_mm_seconds(size, dtype, generator, repeats)


def _best_mm_seconds(size: int, dtype: torch.dtype, generator: torch.Generator,
                     repeats: int) -> float:
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: first-call costs (packing, page faults) not counted
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return best
