"""Where the model comes from and how it is loaded: the checkpoint, its dtype and device, the
attention backend, sampling defaults and the start-up warm-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvpool.attention.selector import ATTENTION_BACKENDS
from kvpool.engine.config.options import check_at_least_one, option, parse_json_object
from kvpool.engine.generation_config import check_generation_config_source
from kvpool.model.dtype import DTYPE_CHOICES, canonical_dtype_name


@dataclass(frozen=True)
class LoadConfig:
    """`model` is a path or a Hugging Face Hub id in the local Hub cache (None: the bundled
    SmolLM2-135M-Instruct).

    `dtype` is kept by name, normalised to "auto", "float32", "bfloat16" or "float16" (aliases
    such as "bf16" or "half", and torch dtypes, are accepted); "auto" becomes a concrete dtype
    when the model is loaded (`kvpool.model.dtype.resolve_dtype`; the engine's `dtype`).

    `generation_config` says where requests' sampling defaults come from, as in vLLM: "auto"
    (the model's generation_config.json), "vllm" (none: SamplingParams' own) or a directory
    holding such a file; `override_generation_config` (HF names, e.g. {"temperature": 0.5}) is
    merged over them (`kvpool.engine.generation_config`).
    """

    TITLE: ClassVar[str] = "model loading"

    model: str | None = option(
        None, "GGUF file, HF directory, Hugging Face Hub id in the local cache (org/name) or "
        "dummy preset (default: SmolLM2)")
    load_format: str = option("auto", choices=("auto", "gguf", "safetensors", "dummy"))
    dtype: str = option(
        "auto", "auto: bfloat16 where the device runs it natively (CUDA sm80+, a CPU with "
        "AVX-512 BF16 or AMX), else float32", choices=DTYPE_CHOICES)
    device: str = option("cpu", "cpu, cuda or auto")
    seed: int = option(0)
    max_model_len: int | None = option(None)  # None: the model's own limit
    attention_backend: str = option(
        "auto", "auto: triton on CUDA; on the CPU the C++ decode kernel (cpu) when it builds, "
        "else the PyTorch reference (torch)", choices=ATTENTION_BACKENDS)
    enable_warmup: bool = option(
        True, "run a dummy batch at start-up so the first request pays no first-use costs")
    generation_config: str = option(
        "auto", "requests' sampling defaults: auto (the model's generation_config.json), vllm "
        "(none), or a directory holding a generation_config.json", metavar="{auto,vllm,DIR}")
    override_generation_config: dict[str, Any] | None = option(
        None, 'merged over those defaults, e.g. \'{"temperature": 0.5}\'',
        parser=parse_json_object, metavar="JSON")

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype_name(self.dtype))
        check_generation_config_source(self.generation_config)
        if self.override_generation_config is not None:
            if not isinstance(self.override_generation_config, Mapping):
                raise ValueError("override_generation_config must be a dict of "
                                 "generation_config.json fields, e.g. {'temperature': 0.5}")
            object.__setattr__(self, "override_generation_config",
                               dict(self.override_generation_config))
        check_at_least_one(max_model_len=self.max_model_len)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
