"""`kvpool inspect` end to end through `kvpool.cli.main`: a real engine's snapshot saved to a
file is summarised, round-tripped as JSON (also through stdin), mapped to a PNG and asked why
a prompt hits; bad files, usage mistakes and server failures are one-line errors; a KV trace
renders as a timeline."""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.cli import main
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts
from kvpool.formats.kv_snapshot import KVSnapshot
from kvpool.formats.kv_trace import TraceHeader
from kvpool.inspect import client
from kvpool.inspect.explain import explain_from_snapshot

PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
          "steps as his father had taught him, and lit the great lamp.")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def saved(smollm2, tmp_path_factory) -> Iterator[tuple[Path, KVSnapshot]]:
    """A snapshot file of an engine that has served PROMPT once (its full blocks cached)."""
    config = EngineConfig(num_gpu_blocks=32, enable_warmup=False)
    engine = LLMEngine(config, build_engine_parts(config, smollm2))
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    snapshot = engine.kv_snapshot()
    engine.close()
    path = tmp_path_factory.mktemp("inspect") / "snap.json"
    path.write_text(json.dumps(snapshot.to_json()))
    yield path, snapshot


def inspect(*argv: str) -> int:
    return main(["inspect", *argv])


def test_the_summary_of_a_file(saved, capsys) -> None:
    path, _ = saved
    assert inspect(str(path)) == 0
    out = capsys.readouterr().out
    assert out.startswith("KV snapshot at ")
    assert "device pool: 32 blocks x 16 tokens" in out and "not leaked" in out


def test_json_round_trips_through_a_file_and_stdin(saved, capsys, monkeypatch) -> None:
    path, snapshot = saved
    assert inspect(str(path), "--json") == 0
    printed = capsys.readouterr().out
    assert KVSnapshot.from_json(json.loads(printed)) == snapshot
    monkeypatch.setattr("sys.stdin", io.StringIO(printed))
    assert inspect("-", "--json") == 0
    assert json.loads(capsys.readouterr().out) == json.loads(printed)


def test_png_writes_the_pool_map(saved, capsys, tmp_path) -> None:
    path, _ = saved
    out_png = tmp_path / "map.png"
    assert inspect(str(path), "--png", str(out_png)) == 0
    assert out_png.read_bytes().startswith(PNG_MAGIC)
    captured = capsys.readouterr()
    assert "device pool" in captured.out and f"wrote {out_png}" in captured.err


def test_explain_a_prompt_from_a_file(saved, capsys, smollm2) -> None:
    path, snapshot = saved
    token_ids = smollm2.tokenizer.encode(PROMPT)
    expected = explain_from_snapshot(snapshot, token_ids, None)
    assert expected.verdicts[0].verdict == "hit" and expected.num_hit_tokens > 0
    assert inspect(str(path), "--prompt", PROMPT) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == expected.summary
    assert " hit " in out
    assert inspect(str(path), "--prompt", PROMPT, "--json") == 0
    assert json.loads(capsys.readouterr().out) == expected.to_json()
    assert inspect(str(path), "--prompt", PROMPT, "--cache-salt", "acme", "--json") == 0
    assert json.loads(capsys.readouterr().out)["num_hit_tokens"] == 0  # another salt


@pytest.mark.parametrize(("content", "message"), [
    ("not json at all", "is not a KV snapshot: not JSON"),
    ('{"hello": 1}', "not a kvpool KV snapshot"),
    ('{"format": "kvpool.kv_snapshot", "version": 2}', "version 2 is not supported"),
    ('{"format": "kvpool.kv_snapshot", "version": 1}', "malformed KV snapshot"),
])
def test_a_file_that_is_not_a_snapshot_is_one_line(tmp_path, capsys, content, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert inspect(str(path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool inspect: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("argv", "message"), [
    ((), "give either a snapshot FILE"),
    (("a.json", "--url", "http://x"), "give either a snapshot FILE"),
    (("trace",), "needs the trace FILE"),
    (("a.json", "b.json"), "unexpected second argument"),
    (("a.json", "--html", "x.html"), "--html applies to `kvpool inspect trace` only"),
    (("trace", "t.jsonl", "--json"), "--json do(es) not apply"),
])
def test_usage_mistakes(capsys, argv, message) -> None:
    assert inspect(*argv) == 2
    assert message in capsys.readouterr().err


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_server(capsys) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    assert inspect("--url", url, "--api-key", "k") == 2
    assert f"cannot reach the kvpool server at {url}" in capsys.readouterr().err


@pytest.mark.parametrize(("api_key", "message"), [
    (None, "needs an API key (401): pass --api-key or set KVPOOL_API_KEY"),
    ("wrong", "refused the API key (401)"),
])
def test_401_says_whether_the_key_is_missing_or_wrong(monkeypatch, capsys, api_key,
                                                      message) -> None:
    seen = {}

    def refuse(method, url, headers, **kwargs):
        seen.update(headers)
        return httpx.Response(401, json={"error": {"message": "invalid API key"}})

    monkeypatch.setattr(client.httpx, "request", refuse)
    monkeypatch.delenv("KVPOOL_API_KEY", raising=False)
    argv = ["--url", "http://server"] + (["--api-key", api_key] if api_key else [])
    assert inspect(*argv) == 2
    assert message in capsys.readouterr().err
    assert seen.get("Authorization") == (f"Bearer {api_key}" if api_key else None)


def test_the_url_mode_reads_the_snapshot_and_asks_the_server_to_explain(
        saved, monkeypatch, capsys) -> None:
    _, snapshot = saved
    explanation = explain_from_snapshot(snapshot, [1, 2, 3], None).to_json()
    calls = []

    def answer(method, url, headers, json=None, **kwargs):
        calls.append((method, url, json))
        body = snapshot.to_json() if url.endswith("/snapshot") else explanation
        return httpx.Response(200, json=body)

    monkeypatch.setattr(client.httpx, "request", answer)
    assert inspect("--url", "http://server/", "--api-key", "k") == 0
    assert "device pool" in capsys.readouterr().out
    assert inspect("--url", "http://server", "--prompt", "hi", "--cache-salt", "s") == 0
    assert capsys.readouterr().out.splitlines()[0] == explanation["summary"]
    assert calls[-1] == ("POST", "http://server/v1/kv/explain",
                         {"prompt": "hi", "cache_salt": "s"})
    assert calls[0][1] == "http://server/v1/kv/snapshot"


def test_trace_renders_a_timeline_next_to_the_file(tmp_path, capsys) -> None:
    header = TraceHeader(0.0, 16, 100, 36864, "bfloat16").to_json()
    steps = [{"e": "step", "s": s, "t": s * 0.01, "u": s, "c": 0, "f": 100 - s, "o": 100}
             for s in range(5)]
    trace = tmp_path / "run.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in [header, *steps]))
    assert inspect("trace", str(trace)) == 0
    captured = capsys.readouterr()
    assert "5 steps" in captured.out and "events: " in captured.out
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "run.html").is_file()
    only_png = tmp_path / "only.png"
    assert inspect("trace", str(trace), "--png", str(only_png)) == 0
    assert only_png.is_file() and not (tmp_path / "only.html").exists()
