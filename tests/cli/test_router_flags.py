"""`kvpool router`'s flags build the router config: the replicas, the policy, the server's key
flags giving the server's tenants, the replicas' admin key from the flag or the environment,
and RouterConfig's own defaults for what is left out; bad input is a one-line error, exit 2.

(The running router, as a process, is tested in tests/router/test_failover.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.cli import build_parser, main
from kvpool.cli.router import REPLICA_ADMIN_KEY_ENV_VAR, router_config_from_args
from kvpool.router.config import RouterConfig


def parse(*flags: str) -> RouterConfig:
    return router_config_from_args(build_parser().parse_args(["router", *flags]))


def test_flags_build_the_router_config(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice:key-a\n")
    config = parse("--replica", "http://a:1", "--replica=http://b:2/", "--policy",
                   "round-robin", "--max-load-imbalance", "0", "--api-key-file", str(keys),
                   "--admin-api-key", "root", "--replica-admin-key", "replica-root",
                   "--health-check-interval", "0.5", "--health-check-failures", "3",
                   "--read-timeout", "0", "--max-request-bytes", "1MiB", "--model", "tiny")
    assert config.replicas == ("http://a:1", "http://b:2")
    assert (config.policy, config.max_load_imbalance) == ("round-robin", 0)
    assert config.access.keys.authenticate("Bearer key-a") == "alice"
    assert config.access.admin_keys.authenticate("Bearer root") == "admin"
    assert config.replica_admin_key == "replica-root"
    assert (config.health_check_interval, config.num_failures_to_remove) == (0.5, 3)
    assert config.read_timeout is None and config.model == "tiny"
    assert config.max_request_bytes == 1 << 20


def test_left_out_flags_take_router_configs_defaults(monkeypatch) -> None:
    for name in ("KVPOOL_API_KEY", "VLLM_API_KEY", REPLICA_ADMIN_KEY_ENV_VAR):
        monkeypatch.delenv(name, raising=False)
    config = parse("--replica", "http://a:1")
    assert config == RouterConfig(replicas=("http://a:1",))
    monkeypatch.setenv(REPLICA_ADMIN_KEY_ENV_VAR, "from-env")
    monkeypatch.setenv("KVPOOL_API_KEY", "k")
    config = parse("--replica", "http://a:1")
    assert config.replica_admin_key == "from-env"
    assert config.access.keys.authenticate("Bearer k") == "default"


@pytest.mark.parametrize("flags, message", [
    (["--replica", "a:1"], "expected http://host:port"),
    (["--replica", "http://a:1", "--replica", "http://a:1"], "only once"),
    (["--replica", "http://a:1", "--health-check-interval", "0"], "health_check_interval"),
    (["--replica", "http://a:1", "--api-key-file", "/no/such/file"], "No such file"),
])
def test_bad_flags_are_one_line_errors(flags, message, capsys) -> None:
    assert main(["router", *flags]) == 2
    assert message in capsys.readouterr().err
