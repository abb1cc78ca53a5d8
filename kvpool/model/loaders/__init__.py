"""Weight loaders: GGUF files, HuggingFace safetensors directories, and random (dummy) weights.

`GGUFLoader` loads on first use, so the `gguf` package is needed only to read GGUF files.
"""

from typing import Any

from kvpool.model.loaders.auto import (
    LOAD_FORMATS,
    detect_load_format,
    load_model,
    make_loader,
    resolve_dtype,
)
from kvpool.model.loaders.base import LoadedModel, WeightLoader
from kvpool.model.loaders.dummy import DummyLoader
from kvpool.model.loaders.hf_dir import SafetensorsLoader


def __getattr__(name: str) -> Any:
    if name == "GGUFLoader":
        from kvpool.model.loaders.gguf_file import GGUFLoader

        return GGUFLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LOAD_FORMATS",
    "DummyLoader",
    "GGUFLoader",
    "LoadedModel",
    "SafetensorsLoader",
    "WeightLoader",
    "detect_load_format",
    "load_model",
    "make_loader",
    "resolve_dtype",
]
