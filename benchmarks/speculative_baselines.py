"""`kvpool bench speculative` with engines that have no speculative decoding beside it, in one
sitting.

    python -m benchmarks.speculative_baselines [kvpool bench speculative flags] --vllm

Every flag of `kvpool bench speculative` (the engine flags included) means the same here; this
adds the baselines. The benchmark is kvpool's own (`kvpool.bench.speculative.run`); a baseline
is handed to it through its `Baseline` interface and runs the grounded workload at every
concurrency, after kvpool, per dtype. `--vllm`: vLLM's CPU build, from its own venv (`make
vllm-venv`, or `--vllm-python`); when it cannot run here (no venv, dummy weights) it is skipped
with a message saying why, and kvpool runs alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks.vllm_speculative import VLLMClosedLoopBaseline
from kvpool.bench import speculative
from kvpool.bench.speculative import Baseline
from kvpool.bench.throughput import BaselineUnavailable
from kvpool.cli.args import add_engine_args, engine_config_from_args
from kvpool.cli.bench import add_speculative_args
from kvpool.engine.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative_baselines",
                                     description=__doc__.split("\n\n")[0])
    add_speculative_args(parser)
    parser.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build (no "
                        "speculation there) on the grounded workload; skipped, saying why, "
                        "where it cannot run")
    parser.add_argument("--vllm-python", default=None, help="the interpreter of vLLM's venv "
                        "(default $KVPOOL_VLLM_PYTHON, else .venv-vllm/bin/python)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(parser)
    return parser


def baselines_from_args(args: argparse.Namespace, config: EngineConfig) -> list[Baseline]:
    """The baselines asked for that can run on `config`; each that cannot is skipped with a
    message on stderr."""
    asked = [VLLMClosedLoopBaseline(args.vllm_python, args.warmup)] if args.vllm else []
    baselines = []
    for baseline in asked:
        try:
            baseline.check(config)
        except BaselineUnavailable as error:
            print(f"speculative_baselines: {baseline.label} skipped: {error}", file=sys.stderr)
            continue
        baselines.append(baseline)
    return baselines


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = engine_config_from_args(args)
        return speculative.run(args, config, baselines_from_args(args, config))
    except (ValueError, FileNotFoundError) as error:  # bad input in one line, as `kvpool`'s
        print(f"speculative_baselines: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
