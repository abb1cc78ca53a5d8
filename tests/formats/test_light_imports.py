"""The observability formats and the router's event readers load without torch: a router, an
inspector or a simulator reads events, traces and snapshots without the engine's weight."""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT_MODULES = [
    "kvpool.formats",
    "kvpool.formats.kv_events",
    "kvpool.formats.kv_trace",
    "kvpool.formats.kv_snapshot",
    "kvpool.router.kv_event_subscriber",
    "kvpool.router.prefix_index",
]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_importing_a_format_does_not_import_torch(module: str) -> None:
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
