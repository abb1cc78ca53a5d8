"""The `kvpool` command line: one subcommand per module, registered below.

Each module in `SUBCOMMAND_MODULES` exposes `register(subparsers)`, which adds its parser and
sets `func(args) -> int`. Registration must stay light (heavy imports happen inside `func`),
so `kvpool --help` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

SUBCOMMAND_MODULES = (
    "kvpool.demo",
    "kvpool.commands.generate",
    "kvpool.commands.chat",
    "kvpool.bench.cli",
    "kvpool.sim.cli",
    "kvpool.server.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool", description="LLM inference on a paged, dynamic KV-cache memory pool."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
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


if __name__ == "__main__":
    sys.exit(main())
