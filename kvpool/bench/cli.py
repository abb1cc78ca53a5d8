"""`kvpool bench <name>`: one subcommand per benchmark module.

Each module in `BENCH_MODULES` exposes `register(bench_subparsers)`, which adds its parser and
sets `func(args) -> int`; adding a benchmark is one line here. As for the top-level CLI,
registration must stay light: a benchmark imports torch or the model inside its `func`.
"""

from __future__ import annotations

import argparse
from importlib import import_module

BENCH_MODULES = ("kvpool.bench.blocks", "kvpool.bench.throughput", "kvpool.bench.serve")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: a readable table, or one JSON object with --json"
    )
    bench_subparsers = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for module_name in BENCH_MODULES:
        import_module(module_name).register(bench_subparsers)
