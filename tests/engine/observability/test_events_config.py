"""`KVEventsConfig`'s privacy defaults: loopback and hashes only; a wildcard bind is refused
while the server has keys unless the operator opts in, and `kvpool serve` says so and exits 2
before loading anything."""

from __future__ import annotations

import json

import pytest

from kvpool.cli import build_parser, main
from kvpool.cli.args import engine_config_from_args
from kvpool.cli.serve import check_kv_events_exposure, server_config_from_args
from kvpool.engine.observability.events_config import KVEventsConfig


def test_the_defaults_bind_loopback_and_publish_no_tokens() -> None:
    config = KVEventsConfig.from_value({"enable_kv_cache_events": True})
    assert config.endpoint == "tcp://127.0.0.1:5557"
    assert config.include_token_ids is False
    assert not config.is_public_bind
    config.check_exposure(has_api_keys=True)  # loopback with keys: fine


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557",
                                      "tcp://:::5557"])
def test_a_wildcard_bind_with_keys_needs_the_operators_opt_in(endpoint: str) -> None:
    config = KVEventsConfig(True, endpoint=endpoint)
    assert config.is_public_bind
    with pytest.raises(ValueError, match="listens on every interface"):
        config.check_exposure(has_api_keys=True)
    config.check_exposure(has_api_keys=False)  # no keys: nothing is private anyway
    KVEventsConfig(True, endpoint=endpoint, allow_public_bind=True).check_exposure(True)
    KVEventsConfig(False, endpoint=endpoint).check_exposure(True)  # events off


def test_serve_refuses_a_wildcard_bind_with_keys(capsys) -> None:
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"})
    argv = ["serve", "tiny", "--load-format", "dummy", "--kv-events-config", events]
    assert main([*argv, "--api-key", "secret"]) == 2
    assert "listens on every interface" in capsys.readouterr().err
    assert main([*argv, "--admin-api-key", "root"]) == 2
    args = build_parser().parse_args(argv)  # no keys: allowed
    check_kv_events_exposure(engine_config_from_args(args), server_config_from_args(args))
    opted_in = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                           "allow_public_bind": True})
    args = build_parser().parse_args(["serve", "tiny", "--load-format", "dummy",
                                      "--api-key", "secret", "--kv-events-config", opted_in])
    check_kv_events_exposure(engine_config_from_args(args), server_config_from_args(args))


@pytest.mark.parametrize(("field", "value"), [("include_token_ids", "yes"),
                                              ("allow_public_bind", 1),
                                              ("curve_client_keys", "one-key")])
def test_bad_privacy_fields_are_refused_naming_them(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        KVEventsConfig.from_value({"enable_kv_cache_events": True,
                                   "curve_secret_key_file": "k", field: value})
