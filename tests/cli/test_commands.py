"""`kvpool generate` and `kvpool chat` end to end on the bundled model."""

from __future__ import annotations

import io

from kvpool.cli import build_parser, chat, main


def test_generate_prints_each_completion(capsys):
    argv = ["generate", "Hello, my name is", "The capital of France is", "--max-tokens", "6"]
    assert main([*argv, "--kv-cache-memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "=== 'Hello, my name is'" in out and "=== 'The capital of France is'" in out
    assert out.count("(6 tokens, finish: length)") == 2
    assert "12 tokens generated" in out


def test_generate_with_quantized_kv(capsys):
    argv = ["generate", "The capital of France is", "--max-tokens", "6", "--ignore-eos"]
    assert main([*argv, "--kv-cache-memory", "64MiB", "--kv-cache-dtype", "fp8"]) == 0
    assert "(6 tokens, finish: length)" in capsys.readouterr().out


def test_chat_streams_replies_and_keeps_the_conversation():
    args = build_parser().parse_args(
        ["chat", "--max-tokens", "8", "--kv-cache-memory", "64MiB", "--ignore-eos"]
    )
    stdin = io.StringIO("Hi! Who are you?\nAnd what can you do?\n/reset\nBye\n/exit\n")
    stdout = io.StringIO()
    assert chat.run(args, stdin=stdin, stdout=stdout) == 0
    transcript = stdout.getvalue()
    assert transcript.count("> ") == 5  # four turns and the /exit prompt
    replies = [line for line in transcript.splitlines()[1:] if line.strip()]
    assert len(replies) >= 3


def test_stream_reply_returns_exactly_the_text_it_streamed(smollm2):
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling_params import SamplingParams
    from kvpool.engine.setup import build_engine_parts

    config = EngineConfig(kv_cache_memory=64 << 20, enable_warmup=False)
    engine = LLMEngine(config, build_engine_parts(config, smollm2))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    stdout = io.StringIO()
    reply = chat.stream_reply(engine, [{"role": "user", "content": "Hi!"}], params, stdout)
    assert reply.strip()
    assert stdout.getvalue() == reply + "\n"
    assert not engine.has_unfinished_requests()


def test_bad_engine_flags_fail_with_a_clear_message(capsys):
    assert main(["generate", "x", "--max-num-seqs", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvpool generate: error: max_num_seqs must be at least 1, got 0"
    )
    assert main(["generate", "x", "--model", "/no/such/model.gguf"]) == 2
    assert "no such model file" in capsys.readouterr().err
