"""The `kvpool` command line: one module per command in this package, registered below.

Each module in `COMMAND_MODULES` exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Registration must stay light: a command imports torch, the model or the
server inside its `func`, so `kvpool --help` answers at once (tests/cli/test_main.py checks that
building the parser imports no torch). The flags every engine-running command shares live in
`kvpool.cli.args`, defined once.

Under torchrun (`torchrun --nproc-per-node 2 -m kvpool serve -tp 2`) every rank runs this
same command: rank 0 runs it as usual, ranks > 0 serve as tensor-parallel workers for rank 0's
engine and exit when it stops (`kvpool.engine.parallel`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import import_module

from kvpool.cli.config_file import expand_config_file

COMMAND_MODULES = (
    "kvpool.cli.demo",
    "kvpool.cli.generate",
    "kvpool.cli.chat",
    "kvpool.cli.serve",
    "kvpool.cli.router",
    "kvpool.cli.simulate",
    "kvpool.cli.bench",
    "kvpool.cli.inspect",
    "kvpool.cli.export_tokenizer",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool", description="LLM inference on a paged, dynamic KV-cache memory pool."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Bad input (a ValueError, a missing file) is reported in one line."""
    parser = build_parser()
    try:
        argv = expand_config_file(parser, list(sys.argv[1:] if argv is None else argv))
    except (ValueError, OSError) as error:
        print(f"kvpool: error: --config: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        if _is_torchrun_worker(args):
            return _run_torchrun_worker(args)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvpool {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _is_torchrun_worker(args: argparse.Namespace) -> bool:
    """Whether this process is one of torchrun's ranks > 0 of a tensor-parallel command."""
    return (getattr(args, "tensor_parallel_size", 1) > 1 and "WORLD_SIZE" in os.environ
            and int(os.environ.get("RANK", "0")) > 0)


def _run_torchrun_worker(args: argparse.Namespace) -> int:
    """Serve rank 0's engine as a worker until it stops."""
    from kvpool.cli.args import engine_config_from_args
    from kvpool.engine.parallel.group import torchrun_rendezvous
    from kvpool.engine.parallel.worker import run_worker

    config = engine_config_from_args(args)
    run_worker(config, torchrun_rendezvous(config.parallel.tensor_parallel_size,
                                           config.parallel.distributed_timeout_seconds))
    return 0
