"""`kvpool serve`'s flags build the server config; a bad key file is a one-line error;
`--log-level` takes any case; `--api-key` repeats or comes from the environment; the metrics
access flags.

(The running server's graceful shutdown, through `python -m kvpool serve`, is tested in
tests/server/test_serve.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.cli import build_parser, main
from kvpool.cli.serve import API_KEY_ENV_VARS, api_keys_from_args, server_config_from_args
from kvpool.openai.auth import METRICS_TENANT


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


@pytest.mark.parametrize(("given", "level"),
                         [("INFO", "info"), ("info", "info"), ("Debug", "debug"),
                          ("WARNING", "warning"), ("trace", "trace")])
def test_the_log_level_is_case_insensitive(given: str, level: str) -> None:
    assert build_parser().parse_args(["serve", "--log-level", given]).log_level == level


def test_an_unknown_log_level_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--log-level", "LOUD"])
    assert exited.value.code == 2
    assert "invalid choice: 'loud'" in capsys.readouterr().err


def test_api_keys_repeat_and_fall_back_to_the_environment(monkeypatch) -> None:
    for name in API_KEY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)

    def keys(*flags: str) -> list[str]:
        return api_keys_from_args(build_parser().parse_args(["serve", *flags]))

    assert keys() == []
    assert keys("--api-key", "a", "--api-key", "b") == ["a", "b"]
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert keys() == ["from-vllm"]
    monkeypatch.setenv("KVPOOL_API_KEY", "from-kvpool")
    assert keys() == ["from-kvpool"]  # kvpool's own variable first
    assert keys("--api-key", "flag") == ["flag"]  # a flag wins over both
    monkeypatch.setenv("KVPOOL_API_KEY", "")
    assert keys() == ["from-vllm"]  # an empty variable counts as unset
    config = server_config_from_args(build_parser().parse_args(
        ["serve", "--api-key", "a", "--api-key", "b"]))
    assert [config.api_keys.authenticate(f"Bearer {key}") for key in "ab"] == ["default"] * 2


def test_metrics_flags_build_the_metrics_access() -> None:
    def config(*flags: str):
        return server_config_from_args(build_parser().parse_args(["serve", *flags]))

    default = config()
    assert not default.metrics_api_keys.is_enabled and not default.allow_unauthenticated_metrics
    keyed = config("--metrics-api-key", "prom")
    assert keyed.metrics_api_keys.authenticate("Bearer prom") == METRICS_TENANT
    assert not keyed.api_keys.is_enabled
    assert config("--allow-unauthenticated-metrics").allow_unauthenticated_metrics


def test_a_metrics_key_and_open_metrics_together_are_an_error(capsys) -> None:
    argv = ["serve", "tiny", "--load-format", "dummy", "--metrics-api-key", "prom",
            "--allow-unauthenticated-metrics"]
    assert main(argv) == 2
    assert "not both" in capsys.readouterr().err


# ------------------------------------------------------------ vLLM's serve flags (issue 28.10)
def _serve_args(argv: list[str]):
    from kvpool.cli.config_file import expand_config_file
    from kvpool.cli.serve_vllm_flags import resolve_model

    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, argv))
    resolve_model(args)
    return args


@pytest.mark.parametrize("argv", [["serve", "--model", "tiny"], ["serve", "tiny"],
                                  ["serve", "tiny", "--model", "tiny"]])
def test_the_model_is_a_flag_or_positional(argv: list[str]) -> None:
    args = _serve_args(argv)
    assert args.model == "tiny"
    assert server_config_from_args(args).served_model_names == ("tiny",)


def test_two_different_models_are_refused(capsys) -> None:
    assert main(["serve", "tiny", "--model", "other", "--load-format", "dummy"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_a_yaml_config_file_gives_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: tiny\nload_format: dummy\nport: 8123\nhost: 0.0.0.0\n"
        "served-model-name: [a, b]\napi-key: [key-1, key-2]\nenable-prefix-caching: false\n"
        "max-logprobs: 5\nallowed-origins: ['https://app.example']\n"
        "enable-tokenizer-info-endpoint: true\nuvicorn-log-level: WARNING\n"
        "override-generation-config: {temperature: 0.5}\n")
    args = _serve_args(["serve", "--config", str(config), "--port", "9000"])
    assert (args.model, args.load_format, args.host, args.port) == ("tiny", "dummy",
                                                                    "0.0.0.0", 9000)
    assert args.enable_prefix_caching is False and args.log_level == "warning"
    assert args.override_generation_config == {"temperature": 0.5}
    server = server_config_from_args(args)
    assert server.served_model_names == ("a", "b")
    assert server.api_keys.authenticate("Bearer key-2") == "default"
    assert server.max_logprobs == 5 and server.enable_tokenizer_info_endpoint
    assert server.cors.allowed_origins == ("https://app.example",)
    assert _serve_args(["serve", f"--config={config}"]).port == 8123


def test_a_config_file_with_an_unknown_key_is_refused(tmp_path: Path, capsys) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("modle: tiny\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "unknown option 'modle'" in capsys.readouterr().err


def test_cors_flags_take_vllm_json_lists_or_plain_values() -> None:
    args = _serve_args(["serve", "--allowed-origins", '["https://a.example", "https://b"]',
                        "--allowed-methods", "GET", "POST", "--allow-credentials"])
    cors = server_config_from_args(args).cors
    assert cors.allowed_origins == ("https://a.example", "https://b")
    assert cors.allowed_methods == ("GET", "POST") and cors.allowed_headers == ("*",)
    assert cors.allow_credentials
    defaults = server_config_from_args(_serve_args(["serve"]))
    assert defaults.cors.allowed_origins == ("*",) and not defaults.cors.allow_credentials
    assert defaults.max_logprobs == 20 and not defaults.enable_tokenizer_info_endpoint


def test_credentials_with_a_wildcard_origin_are_refused(capsys) -> None:
    assert main(["serve", "tiny", "--load-format", "dummy", "--allow-credentials"]) == 2
    assert "--allow-credentials needs --allowed-origins" in capsys.readouterr().err


def test_uvicorn_log_level_is_vllms_name_for_the_log_level() -> None:
    assert build_parser().parse_args(["serve", "--uvicorn-log-level", "debug"]).log_level == "debug"


def test_input_limit_flags_build_the_server_config() -> None:
    defaults = server_config_from_args(build_parser().parse_args(["serve"]))
    assert (defaults.input_workers, defaults.max_grammar_chars,
            defaults.grammar_compile_timeout) == (4, 131_072, 1.0)
    config = server_config_from_args(build_parser().parse_args([
        "serve", "--input-workers", "2", "--max-grammar-chars", "5000",
        "--grammar-compile-timeout", "0.25"]))
    assert (config.input_workers, config.max_grammar_chars,
            config.grammar_compile_timeout) == (2, 5000, 0.25)
    with pytest.raises(ValueError, match="input_workers must be at least 1"):
        server_config_from_args(build_parser().parse_args(["serve", "--input-workers", "0"]))
