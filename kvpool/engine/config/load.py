"""Where the model comes from and how it is loaded and run: the checkpoint, its dtype and device,
the attention backend, CUDA graphs, sampling defaults and the start-up warm-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvpool.attention.selector import ATTENTION_BACKENDS
from kvpool.engine.config.options import check_at_least_one, option, parse_json_object
from kvpool.engine.generation_config import check_generation_config_source
from kvpool.model.dtype import DTYPE_CHOICES, canonical_dtype_name
from kvpool.model.quantization import QUANTIZATION_CHOICES, Quantization


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

    CUDA graphs (vLLM's names): unless `enforce_eager`, a CUDA engine with the triton attention
    backend captures its decode step once per batch size of `cudagraph_capture_sizes` (None:
    vLLM's pattern 1, 2, 4, 8, 16, 24, ... up to `max_cudagraph_capture_size`, itself None:
    min(max_num_seqs, 512)) and replays it for a decode-only step of that many sequences or
    fewer (`kvpool.engine.decode_graphs`); every other step runs eagerly.

    `cpu_threads` fixes the model's CPU thread count; None follows the other processes' load
    (`kvpool.engine.cpu_threads`).

    `quantization` (vLLM's name) says which matmul weights stay quantized in memory
    (`kvpool.model.quantization`): None lets the checkpoint decide (a GGUF's blocks stay as
    stored on the CPU), "gguf" requires that, "int8"/"int4" quantize a float checkpoint at
    load in groups of `quantization_group_size`, "none" dequantizes everything into `dtype`.
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
    cpu_threads: int | None = option(
        None, "threads for the model's CPU ops (default: the cores other processes leave "
        "free, looked at twice a second, at most the threads the process started with)")
    quantization: str | None = option(
        None, "weights kept quantized: gguf (a GGUF's blocks as stored), int8 or int4 "
        "(quantized at load), none (all in --dtype); default: gguf for a GGUF file on the "
        "CPU, else none", choices=QUANTIZATION_CHOICES, aliases=("-q",))
    quantization_group_size: int = option(
        32, "weights per scale for int8/int4 (a multiple of 8 dividing every input width)")
    seed: int = option(0)
    max_model_len: int | None = option(None)  # None: the model's own limit
    attention_backend: str = option(
        "auto", "auto: triton on CUDA; on the CPU the C++ decode kernel (cpu) when it builds, "
        "else the PyTorch reference (torch)", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(
        False, "never capture CUDA graphs: every step runs eagerly (graphs are captured only "
        "on CUDA with the triton attention backend)")
    cudagraph_capture_sizes: tuple[int, ...] | None = option(
        None, "decode batch sizes to capture a CUDA graph for (default: 1 2 4 8 16 24 ... up "
        "to --max-cudagraph-capture-size)", parser=int, nargs="+", metavar="SIZE",
        aliases=("--cuda-graph-sizes",))
    max_cudagraph_capture_size: int | None = option(
        None, "the largest decode batch captured (default: min(max_num_seqs, 512))")
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
        Quantization(self.quantization or "none", self.quantization_group_size)  # validates
        if self.override_generation_config is not None:
            if not isinstance(self.override_generation_config, Mapping):
                raise ValueError("override_generation_config must be a dict of "
                                 "generation_config.json fields, e.g. {'temperature': 0.5}")
            object.__setattr__(self, "override_generation_config",
                               dict(self.override_generation_config))
        check_at_least_one(max_model_len=self.max_model_len,
                           max_cudagraph_capture_size=self.max_cudagraph_capture_size,
                           cpu_threads=self.cpu_threads)
        if self.cudagraph_capture_sizes is not None:
            sizes = tuple(sorted(set(self.cudagraph_capture_sizes)))
            if not sizes or sizes[0] < 1:
                raise ValueError("cudagraph_capture_sizes must be batch sizes of at least 1, "
                                 f"got {list(self.cudagraph_capture_sizes)}")
            object.__setattr__(self, "cudagraph_capture_sizes", sizes)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
