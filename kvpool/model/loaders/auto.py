"""`load_model`: one entry point from "what the user named" to a ready model and tokenizer.

The model is a path, or a Hugging Face Hub id ("org/name") found in the local Hub cache
(`kvpool.model.loaders.hub`). `load_format` picks the source; "auto" decides from the path: a
`.gguf` file (or a directory holding exactly one) is GGUF, a directory with `config.json` and
`*.safetensors` is a HuggingFace checkpoint. Random weights are never chosen implicitly:
`load_format="dummy"` takes a preset name, a `ModelConfig`, or a real model path (whose config
is used), and None means the default model's shape. Under tensor parallelism every rank calls
`load_model` with its `TensorParallel` and builds only its shard, reading only its slices.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from kvpool.attention.backend import AttentionBackend
from kvpool.model import default_model_path, presets
from kvpool.model.config import ModelConfig
from kvpool.model.dtype import resolve_dtype
from kvpool.model.llama import LlamaModel
from kvpool.model.loaders.base import LoadedModel, WeightLoader
from kvpool.model.loaders.dummy import DummyLoader
from kvpool.model.loaders.hf_dir import SafetensorsLoader, is_hf_directory
from kvpool.model.loaders.hub import resolve_model_path
from kvpool.model.parallel import TensorParallel, check_shapes
from kvpool.model.presets import PRESETS
from kvpool.model.quantization import resolve_quantization

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DEFAULT_DUMMY_PRESET = "smollm2-135m"

ModelSource = str | Path | ModelConfig | None


def _gguf_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    candidates = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return candidates[0] if len(candidates) == 1 else None


def detect_load_format(model: str | Path) -> str:
    """"gguf" or "safetensors" for an existing path (or a cached Hub id); ValueError
    otherwise."""
    path = resolve_model_path(model)
    if not path.exists():
        hint = " (a preset: pass load_format='dummy')" if str(model) in PRESETS else ""
        raise ValueError(f"no such model file or directory: {model}{hint}")
    if _gguf_file(path) is not None:
        return "gguf"
    if is_hf_directory(path):
        return "safetensors"
    raise ValueError(
        f"cannot tell the format of {model}: expected a .gguf file, a directory holding one, "
        "or a directory with config.json and *.safetensors"
    )


def make_loader(model: ModelSource, load_format: str = "auto", seed: int = 0,
                keep_quantized: bool = False) -> WeightLoader:
    """The `WeightLoader` for `model` in `load_format` (None = the default SmolLM2 GGUF);
    `keep_quantized`: a GGUF's quantized blocks come as they are stored."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose from {LOAD_FORMATS}")
    if load_format == "dummy":
        return DummyLoader(_dummy_config(model), seed)
    if isinstance(model, ModelConfig):
        raise ValueError("a ModelConfig has no weights: load it with load_format='dummy'")
    path = resolve_model_path(model) if model is not None else default_model_path()
    if load_format == "auto":
        load_format = detect_load_format(path)
    if load_format == "gguf":
        gguf_path = _gguf_file(path)
        if gguf_path is None:
            raise ValueError(f"{path} is not a .gguf file or a directory holding exactly one")
        # Imported here: the `gguf` package is only needed to read GGUF files (GPU machines
        # that load HF directories or dummy weights may not have it).
        from kvpool.model.loaders.gguf_file import GGUFLoader

        return GGUFLoader(gguf_path, keep_quantized)
    return SafetensorsLoader(path)


def _return_freed_memory() -> None:
    """Hand the loader's freed temporaries back to the OS (glibc keeps freed heap pages
    otherwise): the raw blocks and unpacked codes of a quantized load are ~2.5x the weights
    kept, and the bundled GGUF's process stayed 424 MB larger after loading where 196 MB is
    what it holds."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return
    libc.malloc_trim(0)


def _dummy_config(model: ModelSource) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if model is None:
        return presets.preset(DEFAULT_DUMMY_PRESET)
    if str(model) in PRESETS:
        return presets.preset(str(model))
    if not resolve_model_path(model).exists():
        raise ValueError(f"{model!r} is neither a preset ({sorted(PRESETS)}) nor a model path")
    return make_loader(model, "auto").load_config()


def load_model(
    model: ModelSource = None,
    load_format: str = "auto",
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: AttentionBackend | None = None,
    seed: int = 0,
    tp: TensorParallel = TensorParallel.single(),  # noqa: B008 (frozen, immutable)
    quantization: str | None = "none",
    quantization_group_size: int = 32,
) -> LoadedModel:
    """Build the model (this rank's shard of it under `tp`), fill its weights, and load its
    tokenizer and generation config.

    `dtype` is a torch dtype or a name (`kvpool.model.dtype`; "auto" is decided for `device`).
    `attention_backend` defaults to the torch reference backend. `seed` only affects dummy
    weights. `quantization`: `kvpool.model.quantization` (None: the checkpoint decides).
    ValueError if `tp.size` cannot split the model (`check_shapes`).
    """
    start = time.perf_counter()
    device = torch.device(device)
    if attention_backend is None:
        from kvpool.attention.torch_ref import TorchAttentionBackend

        attention_backend = TorchAttentionBackend()
    if load_format == "auto" and not isinstance(model, ModelConfig):
        load_format = detect_load_format(model if model is not None else default_model_path())
    scheme = resolve_quantization(quantization, load_format, device, quantization_group_size)
    loader = make_loader(model, load_format, seed, scheme.keeps_gguf_blocks)
    config = loader.load_config()
    check_shapes(config, tp.size)
    llama = LlamaModel(config, attention_backend, resolve_dtype(dtype, device), device, tp)
    llama.load_weights(loader.iter_weights(config, device, tp), scheme)
    _return_freed_memory()
    llama.pack_weights()
    llama.eval()
    tokenizer = loader.load_tokenizer()
    return LoadedModel(config, llama, tokenizer, time.perf_counter() - start,
                       loader.load_generation_config())
