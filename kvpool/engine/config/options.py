"""How an engine option is declared, once: its default and the facts its CLI flag needs.

Every field of an `EngineConfig` section is declared with `option(default, help, ...)`. The
field owns the default; its `Flag` (in the field's metadata) owns the help text, choices,
parser, metavar and aliases. `kvpool.cli.args` generates the flag from both (vLLM's name:
`--` + the field name with '-', then the aliases), so no default, choice list or help text is
written a second time. Light on purpose (no torch): `kvpool --help` imports it.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import Field, dataclass, field
from typing import Any

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}
_FLAG_KEY = "kvpool.flag"


def parse_size(text: str) -> int:
    """`512MiB`, `1.5GB`, `65536` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 1GB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_json_object(text: str) -> dict[str, Any]:
    """`{"temperature": 0.5}` -> a dict (vLLM's JSON-valued flags)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


@dataclass(frozen=True)
class Flag:
    """The CLI facts of one option. `parser` None: the field's type parses the text (int,
    float; str as given; a bool is a --x / --no-x pair)."""

    help: str | None = None
    parser: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # other spellings, e.g. vLLM's --num-gpu-blocks-override
    metavar: str | None = None
    nargs: str | None = None  # "+": a list of values, each parsed by `parser`


def option(default: Any, help: str | None = None, *, parser: Callable[[str], Any] | None = None,
           choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = (),
           metavar: str | None = None, nargs: str | None = None) -> Any:
    """A config field with its default and its flag's facts."""
    return field(default=default, metadata={
        _FLAG_KEY: Flag(help, parser, choices, tuple(aliases), metavar, nargs)})


def flag_of(config_field: Field) -> Flag:
    """The flag facts `option` stored on a field."""
    return config_field.metadata[_FLAG_KEY]


def flag_name(name: str) -> str:
    """An option's flag, as vLLM spells it: block_size -> --block-size."""
    return "--" + name.replace("_", "-")


def check_at_least_one(**values: int | None) -> None:
    """ValueError naming the first of `values` (None: not given) that is not an integer of at
    least 1 (a size such as "64MiB" is the command line's to parse, not the config's)."""
    for name, value in values.items():
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
