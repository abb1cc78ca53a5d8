"""Which compiled variant of a Triton kernel each launch needs, recorded without a GPU.

Triton compiles one variant per distinct key: the constexpr values, the launch options
(`num_warps`, `num_stages`), each tensor's dtype and 16-byte alignment, and each scalar's type
and whether it is 1 or a multiple of 16 — except for the arguments a kernel lists in
`do_not_specialize` / `do_not_specialize_on_alignment`. The recorder computes that key for
every launch with Triton's own specialisation function (`native_specialize_impl`, backend
independent), so a CPU test under the interpreter sees exactly the keys a GPU would compile.
A test helper: it reaches into Triton's runtime internals.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl


class VariantRecorder:
    """Stands in for kernels on their modules (`monkeypatch`): each launch records its key in
    `keys[kernel name]`, then runs the real kernel."""

    def __init__(self, monkeypatch, kernels: list[tuple[Any, str]]) -> None:
        self.keys: dict[str, set[tuple]] = defaultdict(set)
        for module, name in kernels:
            monkeypatch.setattr(module, name, _Recording(getattr(module, name), self.keys[name]))

    def clear(self) -> None:
        for keys in self.keys.values():
            keys.clear()

    def snapshot(self) -> dict[str, set[tuple]]:
        return {name: set(keys) for name, keys in self.keys.items()}


class _Recording:
    def __init__(self, kernel: Any, keys: set[tuple]) -> None:
        self.kernel = kernel
        self.keys = keys
        self.signature = inspect.signature(kernel.fn)
        options = getattr(kernel, "kwargs", None) or vars(kernel)  # interpreted or compiled
        self.unspecialized = set(options.get("do_not_specialize") or ())
        self.unaligned = set(options.get("do_not_specialize_on_alignment") or ())

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.add(self.key(args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch

    def key(self, args: tuple, kwargs: dict) -> tuple:
        parameters = self.signature.parameters
        bound = self.signature.bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                      if k in parameters})
        key = [tuple(sorted((k, v) for k, v in kwargs.items() if k not in parameters))]
        for name, parameter in parameters.items():
            value = bound.arguments.get(name, parameter.default)
            if "constexpr" in str(parameter.annotation):
                key.append((name, value))
                continue
            specialize, align = name not in self.unspecialized, name not in self.unaligned
            key.append((name, native_specialize_impl(BaseBackend, value, False, specialize,
                                                     align)))
        return tuple(key)
