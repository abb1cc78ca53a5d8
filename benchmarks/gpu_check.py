"""The GPU check's Python steps, one per process (`scripts/gpu_check.sh` runs them in order):

    python -m benchmarks.gpu_check STEP --out DIR [--smoke]

`env` (versions, device, read/copy bandwidth, matmul rate), `e2e` (GPU greedy tokens against
the CPU's, same weights), `attention` (decode kernel vs SDPA), `engine` (kvpool on a dummy
Llama-3-8B), `hf` (transformers on the same weights), `summary` (`gpu_check.json`, targets
checked). Each step appends its measurements to `DIR/results.jsonl` as they finish
(`benchmarks/gpu/results.py`), so a step stopped by its time limit keeps what it measured; a
step that fails records its error and exits 1. `--smoke`: tiny shapes on any device, the CPU
included (CI runs it).

This module imports torch only inside the steps: `summary` needs none.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchmarks.gpu.results import ResultLog
from benchmarks.gpu.step import StepContext

STEPS = ("env", "e2e", "attention", "engine", "hf", "summary")


def run_step(step: str, ctx: StepContext, args: argparse.Namespace) -> None:
    """Import the step's module only now: each step pays for its own imports alone."""
    if step == "summary":
        from benchmarks.gpu.summary import summarize

        summarize(ctx.out, ctx.smoke)
    elif step == "engine":
        from benchmarks.gpu import engine

        engine.run(ctx, args.attention_backend)
    else:
        import importlib

        importlib.import_module(f"benchmarks.gpu.{step}").run(ctx)


def use_interpreter_without_cuda() -> None:
    """A smoke run on a machine without CUDA runs the Triton kernels in Triton's interpreter
    (set before anything imports triton)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--out", type=Path, required=True, help="directory for results.jsonl")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                        help="the engine step's backend")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = StepContext(args.out, args.smoke, ResultLog(args.out, args.step))
    try:
        if args.smoke and args.step != "summary":
            use_interpreter_without_cuda()
        run_step(args.step, ctx, args)
    except Exception as error:  # recorded for the summary; the script goes on to the next step
        traceback.print_exc()
        ctx.log.add("error", error=f"{type(error).__name__}: {error}")
        return 1
    return 1 if ctx.num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
