"""vLLM as a baseline of `kvpool bench speculative` (`VLLMClosedLoopBaseline`, a
`kvpool.bench.speculative.Baseline`): kvpool's grounded runs through vLLM's CPU build, which has
no speculative decoding, in vLLM's own venv (`vllm_closed_loop.py`, the same closed loop as
kvpool's).

The model, its HuggingFace export of a GGUF, the venv and the KV budget are found as for the
throughput baseline (`benchmarks.vllm_baseline`): the same dtype, KV dtype and seed, and kvpool's
KV budget rounded up to whole GiB.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.baseline_process import run_runner
from benchmarks.vllm_baseline import (
    VLLMBaseline,
    hf_model_directory,
    vllm_kv_cache_dtype,
    vllm_kv_cache_gib,
    vllm_python,
)

if TYPE_CHECKING:
    from kvpool.bench.closed_loop import Run
    from kvpool.engine.config import EngineConfig

RUNNER = Path(__file__).with_name("vllm_closed_loop.py")


@dataclass(frozen=True)
class VLLMClosedLoopBaseline:
    """vLLM on kvpool's runs, each at its concurrency, `num_rounds` times (after one untimed
    warm-up), with `max_num_seqs` the largest concurrency."""

    python: str | None  # --vllm-python; None: $KVPOOL_VLLM_PYTHON, else .venv-vllm
    warmup: bool = True
    name: str = "vllm"
    label: str = "vLLM"

    def check(self, config: EngineConfig) -> None:
        VLLMBaseline(self.python, latency_tokens=0).check(config)

    def run(self, config: EngineConfig, runs: list[Run], num_rounds: int,
            kv_cache_bytes: int) -> dict:
        plan = {"model": str(hf_model_directory(config.load.model)), "dtype": config.load.dtype,
                "kv_cache_dtype": vllm_kv_cache_dtype(config.cache.kv_cache_dtype),
                "max_num_seqs": max(run.concurrency for run in runs), "seed": config.load.seed,
                "max_model_len": max_model_len(runs), "rounds": num_rounds,
                "warmup": self.warmup,
                "runs": [{**asdict(run), "label": run.label} for run in runs]}
        gib = vllm_kv_cache_gib(kv_cache_bytes)
        result = run_runner("vLLM", RUNNER, vllm_python(self.python), plan,
                            env={"VLLM_CPU_KVCACHE_SPACE": str(gib)})
        result["kv_cache_gib"] = gib
        return result


def max_model_len(runs: list[Run]) -> int:
    """The most tokens one request holds (prompt and output): vLLM's `max_model_len`, so that it
    does not size itself for the model's whole context (`vllm_baseline.longest_request`)."""
    return max(len(prompt) + run.max_tokens for run in runs for prompt in run.prompts)
