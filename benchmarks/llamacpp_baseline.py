"""llama.cpp as the throughput benchmark's baseline (`LlamaCppBaseline`, a
`kvpool.bench.throughput.Baseline`): the same requests on the same GGUF file, run by
llama-cpp-python in its own venv (`make llamacpp-venv`: built from source for this CPU).

llama.cpp computes with the GGUF's weights as stored (the bundled file is 4-bit), where kvpool
dequantizes them at load: its tokens are compared with kvpool's but need not agree. Two modes,
two baselines: `llamacpp` runs llama-cpp-python's `Llama`, which decodes one sequence at a
time, so a run of N requests is N requests in turn (the figure a `Llama` user gets);
`llamacpp-batched` decodes a run's requests together through the low-level batch API, one
sequence id each (`llamacpp_batched`: what llama.cpp's server does with parallel slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.baseline_process import run_runner, venv_python
from kvpool.bench.throughput import BaselineUnavailable

if TYPE_CHECKING:
    from kvpool.bench.throughput import Runs
    from kvpool.engine.config import EngineConfig

DEFAULT_VENV_PYTHON = Path(".venv-llamacpp") / "bin" / "python"
RUNNER = Path(__file__).with_name("llamacpp_runner.py")
CONTEXT_ROUNDING = 256  # n_ctx rounded up to this many tokens


@dataclass(frozen=True)
class LlamaCppBaseline:
    """llama.cpp on kvpool's requests: the same GGUF file, greedy, EOS ignored, kvpool's
    thread count; one request at a time, or with `batched` all of a run's together."""

    python: str | None  # --llamacpp-python; None: $KVPOOL_LLAMACPP_PYTHON, else .venv-llamacpp
    latency_tokens: int
    batched: bool = False

    @property
    def name(self) -> str:
        return "llamacpp-batched" if self.batched else "llamacpp"

    @property
    def label(self) -> str:
        return "llama.cpp batched" if self.batched else "llama.cpp"

    def check(self, config: EngineConfig) -> None:
        gguf_path(config.load.model)
        venv_python(self.python, "KVPOOL_LLAMACPP_PYTHON", DEFAULT_VENV_PYTHON, "llamacpp-venv")

    def run(self, config: EngineConfig, runs: Runs, kv_cache_bytes: int) -> dict:
        python = venv_python(self.python, "KVPOOL_LLAMACPP_PYTHON", DEFAULT_VENV_PYTHON,
                             "llamacpp-venv")
        plan = self.plan(gguf_path(config.load.model), runs)
        return run_runner(self.label, RUNNER, python, plan)

    def plan(self, model: Path, runs: Runs) -> dict:
        """The runner's plan (`llamacpp_runner`) for `runs` on the GGUF file `model`: a
        sequence's context holds the longest request; batched, there are as many sequences
        as the largest run has requests (every request of a run decodes together)."""
        latency_prompt = runs[0][1][0][0]
        longest = max(len(prompt) + max_tokens
                      for _, requests in runs for prompt, max_tokens in requests)
        longest = max(longest, len(latency_prompt) + self.latency_tokens + 1)
        plan = {"model": str(model),
                "n_ctx": -(-longest // CONTEXT_ROUNDING) * CONTEXT_ROUNDING,
                "n_threads": torch.get_num_threads(),
                "runs": [{"label": label, "requests": requests} for label, requests in runs],
                "latency_prompt": latency_prompt, "latency_tokens": self.latency_tokens}
        if self.batched:
            plan["n_seq_max"] = max(len(requests) for _, requests in runs)
        return plan


def gguf_path(model: str | None) -> Path:
    """The GGUF file llama.cpp reads for kvpool's `model` (the bundled one by default)."""
    from kvpool.model import default_model_path

    path = Path(model) if model else default_model_path()
    if path.suffix != ".gguf":
        raise BaselineUnavailable(f"--baseline llamacpp needs a GGUF file, not {path}")
    return path
