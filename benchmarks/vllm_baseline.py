"""vLLM as the throughput benchmark's baseline (`VLLMBaseline`, a `kvpool.bench.throughput.
Baseline`): the same requests, run in vLLM's own venv.

vLLM and kvpool cannot share an environment (vLLM pins its own dependency set), so vLLM runs
`vllm_runner.py` as a subprocess of the interpreter `make vllm-venv` sets up (`.venv-vllm`),
or the one `--vllm-python` / `$KVPOOL_VLLM_PYTHON` names. The plan it reads holds the token
ids themselves, so both engines see exactly the same prompts.

vLLM cannot read a GGUF's tokenizer offline, so a GGUF model is handed to it as a HuggingFace
directory exported from the same file (`hf_export`). Its CPU backend sizes the KV cache only
from `VLLM_CPU_KVCACHE_SPACE`, in whole GiB: it gets kvpool's KV budget rounded up to a GiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.baseline_process import run_runner, venv_python
from kvpool.bench.throughput import BaselineUnavailable
from kvpool.memory.kv_layout import cdiv

if TYPE_CHECKING:
    from kvpool.bench.throughput import Runs
    from kvpool.engine.config import EngineConfig

GIB = 1024**3
DEFAULT_VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"
RUNNER = Path(__file__).with_name("vllm_runner.py")


@dataclass(frozen=True)
class VLLMBaseline:
    """vLLM on kvpool's requests: the same model (a GGUF as its exported HF directory), dtype,
    KV dtype (`vllm_kv_cache_dtype`), batch limit and seed, and kvpool's KV budget."""

    python: str | None  # --vllm-python; None: $KVPOOL_VLLM_PYTHON, else .venv-vllm
    latency_tokens: int
    name: str = "vllm"
    label: str = "vLLM"

    def check(self, config: EngineConfig) -> None:
        if config.load.load_format == "dummy":
            raise BaselineUnavailable("--baseline vllm needs real weights (a GGUF file or HF "
                                      "directory), not --load-format dummy")
        vllm_python(self.python)
        hf_model_directory(config.load.model)

    def run(self, config: EngineConfig, runs: Runs, kv_cache_bytes: int) -> dict:
        plan = {"model": str(hf_model_directory(config.load.model)), "dtype": config.load.dtype,
                "kv_cache_dtype": vllm_kv_cache_dtype(config.cache.kv_cache_dtype),
                "max_num_seqs": config.scheduling.max_num_seqs, "seed": config.load.seed,
                "runs": [{"label": label, "requests": requests} for label, requests in runs],
                "latency_prompt": runs[0][1][0][0], "latency_tokens": self.latency_tokens}
        plan["max_model_len"] = longest_request(plan)
        return run_vllm(plan, vllm_kv_cache_gib(kv_cache_bytes), vllm_python(self.python))


def vllm_python(explicit: str | None = None) -> Path:
    """The interpreter of vLLM's venv: `explicit`, else $KVPOOL_VLLM_PYTHON, else
    ./.venv-vllm/bin/python; an error that names the make target when there is none."""
    return venv_python(explicit, "KVPOOL_VLLM_PYTHON", DEFAULT_VENV_PYTHON, "vllm-venv")


def hf_model_directory(model: str | None) -> Path:
    """What vLLM loads for kvpool's `model`: a HuggingFace directory as is, a GGUF file (the
    bundled default included) as its exported directory."""
    from benchmarks.hf_export import hf_directory_for
    from kvpool.model import default_model_path

    path = Path(model) if model else default_model_path()
    if path.suffix == ".gguf":
        return hf_directory_for(path)
    if not (path / "config.json").exists():
        raise BaselineUnavailable(f"vLLM needs a GGUF file or a HuggingFace directory: {path}")
    return path


def longest_request(plan: dict) -> int:
    """The most tokens one of `plan`'s requests holds (prompt and output), vLLM's
    `max_model_len`: vLLM refuses to start when a request of the model's full context (40960
    tokens for Qwen3) would not fit its KV cache, while kvpool admits the requests it gets."""
    requests = [request for run in plan["runs"] for request in run["requests"]]
    latency = len(plan["latency_prompt"]) + plan["latency_tokens"] + 1
    return max([latency, *(len(prompt) + max_tokens for prompt, max_tokens in requests)])


def vllm_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """vLLM's `kv_cache_dtype` for kvpool's: the same name, except int8, which vLLM lacks:
    fp8 there (one byte per element too, the like-for-like capacity)."""
    return "fp8" if kv_cache_dtype == "int8" else kv_cache_dtype


def vllm_kv_cache_gib(kv_cache_bytes: int) -> int:
    """vLLM's CPU KV size, whole GiB, for kvpool's budget in bytes (rounded up)."""
    return max(1, cdiv(kv_cache_bytes, GIB))


def run_vllm(plan: dict, kv_cache_gib: int, python: Path) -> dict:
    """Run `plan` (see `vllm_runner`) in vLLM; its result dict. vLLM's log goes to stderr."""
    result = run_runner("vLLM", RUNNER, python, plan,
                        env={"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)})
    result["kv_cache_gib"] = kv_cache_gib
    return result
