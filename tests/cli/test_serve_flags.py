"""`kvpool serve`'s flags build the server config; a bad key file is a one-line error.

(The running server's graceful shutdown, through `python -m kvpool serve`, is tested in
tests/server/test_serve.py.)
"""

from __future__ import annotations

from pathlib import Path

from kvpool.cli import build_parser, main
from kvpool.cli.serve import server_config_from_args


def test_flags_build_the_server_config(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice:key-a\n")
    args = build_parser().parse_args([
        "serve", "tiny", "--load-format", "dummy", "--served-model-name", "a", "b",
        "--api-key-file", str(keys), "--max-concurrent-requests", "0",
        "--max-queued-sequences", "0", "--max-request-bytes", "1MiB",
        "--shutdown-grace-seconds", "5",
    ])
    config = server_config_from_args(args)
    assert config.served_model_names == ("a", "b")
    assert config.api_keys.authenticate("Bearer key-a") == "alice"
    assert config.max_concurrent_requests is None
    assert config.max_queued_sequences is None
    assert config.max_request_bytes == 1 << 20
    assert config.shutdown_grace_seconds == 5
    defaults = server_config_from_args(build_parser().parse_args(["serve"]))
    assert defaults.served_model_names == ("SmolLM2-135M-Instruct",)
    assert not defaults.api_keys.is_enabled
    assert (defaults.max_concurrent_requests, defaults.max_queued_sequences) == (1024, 4096)
    limited = server_config_from_args(
        build_parser().parse_args(["serve", "--max-queued-sequences", "32"]))
    assert limited.max_queued_sequences == 32
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_a_bad_key_file_is_a_clear_error(tmp_path: Path, capsys) -> None:
    keys = tmp_path / "keys"
    keys.write_text("no separator here\n")
    argv = ["serve", "tiny", "--load-format", "dummy", "--api-key-file", str(keys)]
    assert main(argv) == 2
    assert "line 1: expected 'tenant:key'" in capsys.readouterr().err
