"""The KV trace timeline: PNG and self-contained HTML, escaping, empty and large traces."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.formats.kv_trace import KVTrace, TraceHeader, read_kv_trace
from kvpool.inspect.timeline import StepSeries, downsample, write_timeline

HEADER = TraceHeader(time=0.0, block_size=16, num_blocks=100, bytes_per_block=36864,
                     kv_cache_dtype="bfloat16")
HOSTILE = "<script>alert(1)</script>"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_trace(path: Path, events: list[dict[str, Any]]) -> Path:
    lines = [HEADER.to_json(), *events]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def step(index: int, used: int, cached: int, online: int = 100) -> dict[str, Any]:
    return {"e": "step", "s": index, "t": index * 0.02, "u": used, "c": cached,
            "f": online - used - cached, "o": online}


def small_events() -> list[dict[str, Any]]:
    events = [{"e": "arrive", "s": 0, "t": 0.0, "r": HOSTILE, "p": 40, "n": 1, "h": ["a", "b"]},
              {"e": "alloc", "s": 0, "t": 0.001, "r": HOSTILE, "q": 0, "b": [1, 2, 3]}]
    events += [step(index, min(10 + 3 * index, 90), 5) for index in range(30)]
    events += [
        {"e": "hit", "s": 5, "t": 0.1, "r": "req-2", "q": 0, "b": [4], "c": 16},
        {"e": "preempt", "s": 12, "t": 0.24, "r": HOSTILE, "q": 0, "m": "recompute",
         "b": [1, 2, 3]},
        {"e": "evict", "s": 13, "t": 0.26, "b": [7, 8]},
        {"e": "grow", "s": 20, "t": 0.4, "n": 120, "d": 20},
        {"e": "free", "s": 29, "t": 0.58, "r": HOSTILE, "q": 0, "b": [1, 2, 3]},
        {"e": "finish", "s": 29, "t": 0.58, "r": HOSTILE, "o": 12, "why": "stop"},
        {"e": HOSTILE, "s": 29, "t": 0.59},  # an unknown kind is counted, and escaped
    ]
    return sorted(events, key=lambda event: event["t"])


def test_png_and_html(tmp_path: Path) -> None:
    trace = read_kv_trace(write_trace(tmp_path / "t.jsonl", small_events()))
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    summary = write_timeline(trace, png, page)
    assert (summary.num_steps, summary.peak_used_blocks, summary.num_preemptions) == (30, 90, 1)
    assert (summary.num_evicted_blocks, summary.num_hit_tokens) == (2, 16)
    assert summary.event_counts["step"] == 30 and summary.event_counts[HOSTILE] == 1
    assert summary.duration_s == pytest.approx(0.59)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    text = page.read_text()
    assert 'src="http' not in text and "<script" not in text and "http-equiv" not in text
    assert HOSTILE not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "step 7 · 0.140 s · used 31 · cached 5 · free 64 · online 100" in text
    assert "preempt &lt;script&gt;" in text and "grow +20 blocks, 120 online" in text


def test_only_one_output(tmp_path: Path) -> None:
    trace = KVTrace(HEADER, small_events())
    write_timeline(trace, None, tmp_path / "only.html")
    write_timeline(trace, tmp_path / "only.png", None)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["only.html", "only.png"]


def test_empty_trace(tmp_path: Path) -> None:
    trace = read_kv_trace(write_trace(tmp_path / "empty.jsonl", []))
    summary = write_timeline(trace, tmp_path / "e.png", tmp_path / "e.html")
    assert (summary.num_steps, summary.peak_used_blocks, summary.event_counts) == (0, 0, {})
    assert (tmp_path / "e.png").read_bytes().startswith(PNG_MAGIC)
    assert "Nothing recorded" in (tmp_path / "e.html").read_text()


def test_events_without_steps(tmp_path: Path) -> None:
    events = [{"e": "arrive", "s": 0, "t": 0.5, "r": "a", "p": 3, "n": 1, "h": []}]
    summary = write_timeline(KVTrace(HEADER, events), tmp_path / "n.png", tmp_path / "n.html")
    assert summary.event_counts == {"arrive": 1} and summary.duration_s == 0.5
    assert "(1 events)" in (tmp_path / "n.html").read_text()


def test_downsample_keeps_the_used_peak() -> None:
    used = np.zeros(10_000)
    used[4321] = 77
    series = StepSeries(np.arange(10_000.0), np.arange(10_000.0) / 50, used, 100 - used,
                        np.zeros(10_000), np.full(10_000, 100.0))
    small = downsample(series, 100)
    assert len(small) == 100 and small.used.max() == 77
    assert 4321 in small.step and np.all(small.used + small.cached == 100)


def test_large_trace_renders_fast(tmp_path: Path) -> None:
    num_steps = 100_000
    used = (50 + 40 * np.sin(np.arange(num_steps) / 500)).astype(int)
    events: list[dict[str, Any]] = []
    for index in range(num_steps):
        events.append(step(index, int(used[index]), 5))
        if index % 10 == 0:
            events.append({"e": "alloc", "s": index, "t": index * 0.02, "r": f"r{index}",
                           "q": 0, "b": [1]})
        if index % 50 == 0:
            events.append({"e": "evict", "s": index, "t": index * 0.02, "b": [2]})
        if index % 200 == 0:
            events.append({"e": "preempt", "s": index, "t": index * 0.02, "r": f"r{index}",
                           "q": 0, "m": "swap", "b": [3]})
    start = time.perf_counter()
    summary = write_timeline(KVTrace(HEADER, events), tmp_path / "big.png", tmp_path / "big.html")
    assert time.perf_counter() - start < 8
    assert summary.num_steps == num_steps and summary.peak_used_blocks == used.max()
    assert (tmp_path / "big.html").stat().st_size < 3_000_000
