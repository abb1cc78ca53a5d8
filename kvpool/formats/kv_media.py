"""The names KV events and snapshots give a pool: its medium, and for a hybrid model's KV cache
groups past the first (`kvpool.memory.kv_groups`) the group too, "device/g1", "host/g1".

One module for both formats (`kvpool.formats.kv_events`, `kvpool.formats.kv_snapshot`), free of
their dependencies: the engine names its snapshot's pools with it, msgspec or not.
"""

from __future__ import annotations


def group_medium(medium: str, group: int) -> str:
    """The medium events name for `medium`'s pool of KV cache group `group` (module
    docstring): the medium itself for the first group."""
    return f"{medium}/g{group}" if group else medium


def split_medium(medium: str) -> tuple[str, int]:
    """(medium, group) of an event's medium (`group_medium`'s inverse; a medium with no
    group part is the first group's)."""
    base, sep, group = medium.rpartition("/g")
    return (base, int(group)) if sep and group.isdigit() else (medium, 0)
