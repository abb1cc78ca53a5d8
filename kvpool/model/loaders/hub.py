"""Model names that are Hugging Face Hub ids ("org/name"), found in the local Hub cache.

`resolve_model_path` is the one place a model name becomes a path. A name that exists on disk
is a path, whatever it looks like (so a local `org/name` directory wins, as in vLLM). Otherwise
an `org/name` id is looked up in huggingface_hub's cache (`HF_HUB_CACHE`, by default
`$HF_HOME/hub`): `models--org--name/snapshots/<commit>/`, the commit named by `refs/main`.

kvpool never downloads: the cache is filled by `hf download org/name` (or by any earlier
transformers or vLLM run), and a model missing from it is a ValueError that says so, and how
to get it. `HF_HUB_OFFLINE` makes no difference to the look-up, only to that message.
"""

from __future__ import annotations

import re
from pathlib import Path

# "namespace/name" as the Hub spells repository ids; a bare name (a kvpool preset such as
# "tiny", or a file name) is never taken for one.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(model: str | Path) -> bool:
    """Whether `model` is shaped like a Hub repository id ("org/name")."""
    return isinstance(model, str) and _REPO_ID.fullmatch(model) is not None


def resolve_model_path(model: str | Path) -> Path:
    """The path `model` names: itself if it exists (or is no Hub id), else the cached snapshot
    of the Hub model it names; ValueError, saying how to get it, when that is not cached."""
    path = Path(model)
    if path.exists() or not is_hub_id(model):
        return path
    return cached_snapshot(str(model))


def cached_snapshot(repo_id: str) -> Path:
    """The directory of `repo_id`'s main revision in the local Hub cache."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ValueError(_missing_message(repo_id, constants.HF_HUB_CACHE,
                                          constants.HF_HUB_OFFLINE)) from None


def _missing_message(repo_id: str, cache_dir: str, is_offline: bool) -> str:
    why = ("HF_HUB_OFFLINE is set, and kvpool loads Hub models only from the local cache"
           if is_offline else "kvpool loads Hub models only from the local cache, and never "
           "downloads them")
    return (
        f"model {repo_id!r} is neither a local file or directory nor a Hugging Face model in "
        f"the local cache ({cache_dir}): {why}. On a machine with network access, run "
        f"`hf download {repo_id}` with the same HF_HOME / HF_HUB_CACHE (or pass a local path)."
    )
