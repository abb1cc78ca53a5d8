"""`kvpool bench snapshot` on a small pool: it fills the pool as asked and reports every
timing (the 100,000-block figure itself is a benchmark run, not a test)."""

from __future__ import annotations

import json

from kvpool.cli import main


def test_the_snapshot_bench_reports_a_busy_pool(capsys):
    assert main(["bench", "snapshot", "--num-blocks", "3000", "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    blocks = result["blocks"]
    assert blocks["used"] >= 0.6 * 3000 and blocks["cached"] > 0
    assert sum(blocks.values()) == 3000
    for name in ("snapshot_ms", "to_json_ms", "json_dumps_ms"):
        assert 0 < result[name]["best"] <= result[name]["median"]
    assert result["num_runs"] < 3000 and result["json_bytes"] > 0
