"""Where the cache salt secret comes from (`kvpool.openai.salt_secret`): the flag's file, else
the environment, else a generated 0600 file that a restart (or a second process) reads back;
and the salts it keys: stable for one secret, different under another."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvpool.cli import build_parser
from kvpool.cli.router import router_config_from_args
from kvpool.cli.serve import server_config_from_args
from kvpool.openai.auth import TenantSalts, tenant_of_salt
from kvpool.openai.salt_secret import ENV_VAR, SECRET_FILE_NAME, resolve_salt_secret


def test_the_flag_wins_then_the_environment(tmp_path: Path, monkeypatch) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-the-flag-file-0123456789\n")
    monkeypatch.setenv(ENV_VAR, "from-the-environment-0123456789")
    assert resolve_salt_secret(secret_file) == b"from-the-flag-file-0123456789"
    assert resolve_salt_secret() == b"from-the-environment-0123456789"
    secret_file.write_text("short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        resolve_salt_secret(secret_file)


def test_a_generated_secret_is_private_and_survives_a_restart(tmp_path: Path,
                                                              monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    first = resolve_salt_secret()
    path = tmp_path / "xdg" / "kvpool" / SECRET_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_salt_secret() == first and len(first) == 64  # read back, not regenerated
    disk_dir = tmp_path / "disk"
    in_disk_dir = resolve_salt_secret(cache_dir=disk_dir)
    assert (disk_dir / SECRET_FILE_NAME).exists() and in_disk_dir != first
    assert sorted(p.name for p in disk_dir.iterdir()) == [SECRET_FILE_NAME]  # no temp left


def test_serve_and_router_key_salts_alike(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("shared-by-replicas-and-routers\n")
    flag = ["--cache-salt-secret-file", str(secret_file)]
    serve = server_config_from_args(build_parser().parse_args(["serve", *flag]))
    router = router_config_from_args(build_parser().parse_args(
        ["router", "--replica", "http://127.0.0.1:1", *flag]))
    assert serve.tenant_salts == router.tenant_salts
    salt = serve.tenant_salts.cache_salt("alice", None)
    assert tenant_of_salt(salt) == "alice" and salt != "alice"
    assert TenantSalts(b"another-secret-0123456789").cache_salt("alice", None) != salt
