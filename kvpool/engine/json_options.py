"""vLLM's JSON-valued engine options (`kv_events_config`, `kv_transfer_config`): the one way
they are read from a dict or its JSON text, with errors that name the option and the field."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def option_fields(option: str, value: Mapping[str, Any] | str) -> dict[str, Any]:
    """The fields of `option` given as a dict or its JSON text (the CLI's): a copy;
    ValueError naming the option for text that is not JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{option} is not JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{option} must be a JSON object")
    return dict(value)


def drop_unsupported(option: str, fields: dict[str, Any], neutral: Mapping[str, Any],
                     why: str) -> None:
    """Remove vLLM's fields kvpool takes only at their `neutral` value; ValueError naming the
    first given at another."""
    for name, allowed in neutral.items():
        if name in fields and fields.pop(name) != allowed:
            raise ValueError(f"{option}: {name} is not supported ({why})")


def check_known(option: str, fields: Mapping[str, Any], known: Iterable[str]) -> None:
    """ValueError listing the fields of `option` that are none of `known`."""
    known = set(known)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{option}: unknown fields {unknown} (known: {sorted(known)})")
