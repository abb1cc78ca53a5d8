"""The server secret that tenants' cache salts are derived from (`kvpool.openai.auth.TenantSalts`).

Why a secret: a salt that is only the tenant's name can be computed by anyone who guesses the
name, and then a guessed prompt's block hashes can be looked for wherever hashes show. Keyed
with a secret the salts cannot be computed outside the server.

Where it comes from, first found wins:

    1. `--cache-salt-secret-file FILE` (serve and router): the file's text, stripped;
    2. the `KVPOOL_CACHE_SALT_SECRET` environment variable;
    3. a generated file, `cache-salt-secret` (mode 0600, 32 random bytes in hex), in the disk
       tier's directory if there is one, else in `$XDG_CACHE_HOME/kvpool` (`~/.cache/kvpool`).
       It is kept, so a restarted server derives the same salts and finds its disk blocks.

Replicas that share a Redis tier (or a disk directory), and a router in front of replicas, must
derive the same salts: give them all the same secret (a file or the variable). The generated
file is created once, atomically (written under a temporary name, then linked into place), so
two processes starting together read the same secret.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
from pathlib import Path

__all__ = ["ENV_VAR", "SECRET_FILE_NAME", "default_secret_dir", "resolve_salt_secret"]

logger = logging.getLogger(__name__)

ENV_VAR = "KVPOOL_CACHE_SALT_SECRET"
SECRET_FILE_NAME = "cache-salt-secret"
MIN_SECRET_CHARS = 16


def resolve_salt_secret(secret_file: str | os.PathLike[str] | None = None,
                        cache_dir: str | os.PathLike[str] | None = None) -> bytes:
    """The secret, as the module docstring orders the sources; ValueError for a secret that
    is too short, OSError for a file that cannot be read or created."""
    if secret_file is not None:
        return _checked(Path(secret_file).read_text(encoding="utf-8").strip(),
                        f"--cache-salt-secret-file {str(secret_file)!r}")
    if os.environ.get(ENV_VAR):
        return _checked(os.environ[ENV_VAR].strip(), f"${ENV_VAR}")
    path = (Path(cache_dir) if cache_dir is not None else default_secret_dir()) / SECRET_FILE_NAME
    logger.info("cache salt secret: %s (replicas and routers sharing blocks need the same)",
                path)
    return _checked(_generated(path), str(path))


def default_secret_dir() -> Path:
    """`$XDG_CACHE_HOME/kvpool`, else `~/.cache/kvpool`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvpool"


def _checked(secret: str, source: str) -> bytes:
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the cache salt secret from {source} must be at least "
                         f"{MIN_SECRET_CHARS} characters")
    return secret.encode("utf-8")


def _generated(path: Path) -> str:
    """The secret in `path`, created there first if it does not exist."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=".salt-")  # 0600
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as temp:
                temp.write(secrets.token_hex(32) + "\n")
                temp.flush()
                os.fsync(temp.fileno())
            with contextlib.suppress(FileExistsError):  # another process got there first
                os.link(temp_name, path)
        finally:
            os.unlink(temp_name)
    return path.read_text(encoding="utf-8").strip()
