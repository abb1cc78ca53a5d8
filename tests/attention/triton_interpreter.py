"""Switching Triton to its CPU interpreter for a test module, when there is no CUDA device.

`TRITON_INTERPRET` is read when `@triton.jit` decorates a function (Triton's own library
functions included), so a test module that runs the kernels on CPU tensors calls
`import_kernels_for_the_interpreter()` at import — at collection, before any test runs — and
imports the kernel modules only after it. The environment is restored afterwards, so no
subprocess inherits it; inside this process Triton stays in interpreter mode. With CUDA nothing
is switched. A test helper: `tests/attention/test_triton_kernels.py` and
`tests/engine/test_decode_graphs.py` use it.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

import kvpool.attention

KERNEL_MODULES = ("triton_kv", "triton_tiles", "triton_decode", "triton_prefill",
                  "triton_backend")
IS_INTERPRETED = not torch.cuda.is_available()
DEVICE = "cpu" if IS_INTERPRETED else "cuda"


def import_kernels_for_the_interpreter() -> None:
    """Import triton and the kernel modules in interpreter mode, then restore the environment.

    `triton.knobs.runtime.interpret` keeps the mode for Triton's later lazy imports (the knob
    lives in this process; the environment variable would also reach subprocesses). Another
    test module may have switched it already: the kernel modules are imported again, the same.
    """
    if "triton" in sys.modules:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(standard.cdiv, InterpretedFunction):
            raise RuntimeError(
                "triton was imported before these tests could enable its interpreter; "
                "run this test module in a process of its own"
            )
    for short in KERNEL_MODULES:  # drop compiled-mode copies, if any were imported
        sys.modules.pop(f"kvpool.attention.{short}", None)
        vars(kvpool.attention).pop(short, None)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        triton.knobs.runtime.interpret = True
        for short in KERNEL_MODULES:
            importlib.import_module(f"kvpool.attention.{short}")
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
