"""Optional dependencies: imported when a feature that needs them is used, never at
`import kvpool` or when an offline engine starts.

The offline engine (`from kvpool import LLM`) needs torch, transformers, gguf and safetensors;
the shared Redis tier (redis), structured outputs (xgrammar), KV events (pyzmq, msgspec) and
the HTTP server (FastAPI) need more. Those features import their packages through `require`,
which names the feature and the package to install when one is missing, so a machine without
them (a bare GPU image) still loads and runs models.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, feature: str) -> ModuleType:
    """`import module`, or ImportError saying that `feature` needs its package installed."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise ImportError(f"{feature} needs the package {package!r}, which is not "
                          f"installed") from error
