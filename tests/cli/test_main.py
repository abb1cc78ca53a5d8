"""The `kvpool` entry point: every command is registered, and building the parser stays light
(no torch, no model, no server), so `kvpool --help` answers at once."""

from __future__ import annotations

import json
import subprocess
import sys

from kvpool.cli import build_parser

COMMANDS = {"demo", "generate", "chat", "serve", "router", "simulate", "bench", "inspect",
            "export-tokenizer"}
HEAVY_MODULES = ("torch", "triton", "transformers", "numpy", "fastapi", "uvicorn", "gguf")
# A fresh interpreter: this test process has long imported torch through other tests.
PROBE = f"""
import json, sys
from kvpool.cli import build_parser
build_parser()
print(json.dumps([name for name in {HEAVY_MODULES!r} if name in sys.modules]))
"""


def test_every_command_is_registered() -> None:
    subparsers = build_parser()._subparsers._group_actions[0]
    assert set(subparsers.choices) == COMMANDS
    bench = subparsers.choices["bench"]._subparsers._group_actions[0]
    assert set(bench.choices) == {"blocks", "throughput", "serve", "precision", "kv-capacity",
                                  "kv-granularity", "multi-turn", "structured", "kv-trace",
                                  "snapshot", "tp", "scale-out", "speculative", "disagg"}


def test_building_the_parser_imports_nothing_heavy() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(result.stdout) == []


def test_python_m_kvpool_help_lists_the_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpool", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    for command in COMMANDS:
        assert command in result.stdout
