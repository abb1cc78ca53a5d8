"""Run a Python statement with the optional dependencies hidden, as on a bare GPU image:

    python -m tests.optional_blocker "statement"

A meta-path finder placed first refuses every module of `HIDDEN`, so an import of one fails as
if the package were not installed, however it is reached."""

from __future__ import annotations

import importlib.abc
import sys

# What the device image lacks (issue 29), with what they pull in: the Redis tier's, structured
# outputs', KV events', the HTTP server's and the Mooncake KV transport's packages.
HIDDEN = frozenset({"redis", "xgrammar", "tvm_ffi", "pydantic", "pydantic_core", "zmq",
                    "msgspec", "fastapi", "starlette", "uvicorn", "mooncake"})


class HidingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, HidingFinder())
    exec(compile(sys.argv[1], "<statement>", "exec"), {"__name__": "__statement__"})
