"""Requests from a recorded KV trace: prefix groups from hash chains, lengths, arrivals, dropped
requests, and `kvpool simulate --trace kv` end to end on a hand-written trace file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.cli import main
from kvpool.formats.kv_trace import KVTrace, TraceHeader, read_kv_trace
from kvpool.sim.kv_trace_replay import requests_from_kv_trace

HEADER = TraceHeader(time=0.0, block_size=16, num_blocks=64, bytes_per_block=36864,
                     kv_cache_dtype="bfloat16")


def arrive(request_id: str, step: int, prompt_len: int, hashes: list[str],
           n: int = 1) -> dict[str, Any]:
    return {"e": "arrive", "s": step, "t": step * 0.01, "r": request_id, "p": prompt_len,
            "n": n, "h": hashes}


def finish(request_id: str, step: int, output_len: int) -> dict[str, Any]:
    return {"e": "finish", "s": step, "t": step * 0.01, "r": request_id, "o": output_len,
            "why": "length"}


def write_trace(path: Path, events: list[dict[str, Any]]) -> Path:
    lines = [HEADER.to_json(), *events]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_arrivals_lengths_and_unfinished() -> None:
    events = [arrive("a", 0, 40, ["x1", "x2"]), arrive("b", 3, 20, ["y1"]),
              {"e": "step", "s": 3, "t": 0.03, "u": 5, "c": 0, "f": 59, "o": 64},
              arrive("c", 4, 10, []), finish("b", 9, 7), finish("a", 12, 30)]
    replay = requests_from_kv_trace(KVTrace(HEADER, events))
    assert [(r.request_id, r.arrival, r.prompt_len, r.output_len) for r in replay.requests] == [
        (0, 0.0, 40, 30), (1, 3.0, 20, 7)]
    assert replay.num_unfinished == 1
    assert replay.num_dropped == 1
    assert replay.num_samples == 1
    assert "replayed 2 requests" in replay.describe()
    assert "dropped 1 (1 still running" in replay.describe()


def test_groups_from_longest_shared_run() -> None:
    # a and b share 3 blocks; c shares 1 with them; d shares nothing; e repeats b's first 2.
    chains = {"a": ["h1", "h2", "h3", "a4"], "b": ["h1", "h2", "h3"], "c": ["h1", "c2"],
              "d": ["d1", "d2"], "e": ["h1", "h2"]}
    events = [arrive(rid, step, 16 * len(chain) + 5, chain)
              for step, (rid, chain) in enumerate(chains.items())]
    events += [finish(rid, 20, 4) for rid in chains]
    requests = requests_from_kv_trace(KVTrace(HEADER, events)).requests
    assert [(r.prefix_group, r.prefix_len) for r in requests] == [
        (0, 48), (0, 48), (1, 16), (None, 0), (2, 32)]


def test_equal_short_hashes_under_different_parents_are_not_shared() -> None:
    events = [arrive("a", 0, 40, ["p", "same"]), arrive("b", 0, 40, ["q", "same"]),
              finish("a", 5, 2), finish("b", 5, 2)]
    requests = requests_from_kv_trace(KVTrace(HEADER, events)).requests
    assert [r.prefix_group for r in requests] == [None, None]


def test_reused_id_pairs_with_oldest_open_arrival_and_samples() -> None:
    events = [arrive("r", 0, 8, [], n=2), finish("r", 4, 3), arrive("r", 5, 9, [], n=2),
              finish("r", 7, 0), arrive("s", 6, 9, [], n=1)]
    replay = requests_from_kv_trace(KVTrace(HEADER, events))
    assert [(r.arrival, r.output_len) for r in replay.requests] == [(0.0, 3)]
    assert (replay.num_unfinished, replay.num_without_output) == (1, 1)
    assert replay.sample_counts == {2: 1}
    assert replay.num_samples == 2


def test_bad_event_names_the_request() -> None:
    events = [{"e": "arrive", "s": 0, "t": 0.0, "r": "x", "h": []}, finish("x", 1, 2)]
    with pytest.raises(ValueError, match=r"'x'.*'p'"):
        requests_from_kv_trace(KVTrace(HEADER, events))


def test_round_trip_through_the_reader(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [arrive("a", 2, 30, ["h"]), finish("a", 6, 5)])
    replay = requests_from_kv_trace(read_kv_trace(path))
    assert replay.header == HEADER
    assert replay.requests[0].final_len == 35


def sample_trace(tmp_path: Path) -> Path:
    events = []
    for index in range(12):
        chain = ["sys1", "sys2", f"u{index}"] if index % 2 else [f"v{index}"]
        events.append(arrive(f"req-{index}", index, 16 * len(chain) + 3, chain))
    events += [finish(f"req-{index}", 40, 10 + index) for index in range(11)]
    return write_trace(tmp_path / "kv.jsonl", events)


def test_cli_replays_a_kv_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = sample_trace(tmp_path)
    assert main(["simulate", "--trace", "kv", "--trace-file", str(path), "--block-sizes",
                 "16,32", "--max-seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "replayed 11 requests from the KV trace, dropped 1 (1 still running" in out
    assert "paged-32" in out and "paged-16+prefix" in out
    # The recorded pool: 64 blocks x 16 tokens of smollm2-135m, rounded up to 256 B.
    assert "= 1024 tokens of smollm2-135m" in out


def test_cli_json_puts_the_replay_line_on_stderr(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    path = sample_trace(tmp_path)
    assert main(["simulate", "--trace", "kv", "--trace-file", str(path), "--block-sizes", "16",
                 "--budget", "4MiB", "--max-seq-len", "128", "--json"]) == 0
    captured = capsys.readouterr()
    assert {r["strategy"] for r in json.loads(captured.out)} >= {"paged-16", "paged-16+prefix"}
    assert "replayed 11 requests" in captured.err


def test_cli_refuses_kv_trace_as_jsonl(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    path = sample_trace(tmp_path)
    assert main(["simulate", "--trace", "jsonl", "--trace-file", str(path)]) == 2
    assert "--trace kv" in capsys.readouterr().err
    assert main(["simulate", "--trace", "kv"]) == 2
    assert "--trace kv needs --trace-file" in capsys.readouterr().err


def test_cli_takes_the_recorded_n(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    events = [arrive(f"r{index}", index, 20, [], n=2) for index in range(4)]
    events += [finish(f"r{index}", 30, 8) for index in range(4)]
    path = write_trace(tmp_path / "n2.jsonl", events)
    assert main(["simulate", "--trace", "kv", "--trace-file", str(path), "--block-sizes", "16",
                 "--max-seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "2 sample(s) each" in out and "paged-16+fork" in out


def test_step_numbers_starting_again_continue_the_clock() -> None:
    events = [arrive("a", 0, 8, []), arrive("b", 4, 8, []), finish("a", 6, 2),
              arrive("c", 0, 8, []), arrive("d", 3, 8, []), finish("b", 5, 1), finish("c", 5, 1),
              finish("d", 6, 1)]
    requests = requests_from_kv_trace(KVTrace(HEADER, events)).requests
    assert [r.arrival for r in requests] == [0.0, 4.0, 7.0, 10.0]
