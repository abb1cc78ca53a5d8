"""The `kvpool` command line: one module per command in this package, registered below.

Each module in `COMMAND_MODULES` exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Registration must stay light: a command imports torch, the model or the
server inside its `func`, so `kvpool --help` answers at once (tests/cli/test_main.py checks that
building the parser imports no torch). The flags every engine-running command shares live in
`kvpool.cli.args`, defined once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

COMMAND_MODULES = (
    "kvpool.cli.demo",
    "kvpool.cli.generate",
    "kvpool.cli.chat",
    "kvpool.cli.serve",
    "kvpool.cli.simulate",
    "kvpool.cli.bench",
    "kvpool.cli.inspect",
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
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvpool {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
