"""kvpool: an LLM inference engine built around a paged, dynamic KV-cache memory pool.

The heavy parts (torch, the model, the engine) load on first use, so `import kvpool` and the
pure-Python memory core stay light.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY_EXPORTS = {
    "LLM": "kvpool.engine.llm",
    "SamplingParams": "kvpool.engine.sampling_params",
    "RequestOutputKind": "kvpool.engine.sampling_params",
    "RequestOutput": "kvpool.engine.requests.outputs",
    "CompletionOutput": "kvpool.engine.requests.outputs",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    return getattr(import_module(module_name), name)


__all__ = sorted(_LAZY_EXPORTS)
