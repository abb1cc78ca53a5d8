"""`--config FILE`: a command's flags from a YAML file, as vLLM's `vllm serve --config`.

The file is a mapping of flag names (with `-` or `_`, without the leading `--`) to values:

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    port: 8001
    enable-prefix-caching: true
    served-model-name: [smol, default]
    api-key: [key-a, key-b]

`expand_config_file` turns it into command-line arguments placed right after the command, before
the arguments actually typed, so a flag given on the command line wins (argparse keeps the
last value; a repeatable flag such as `--api-key` gets the file's values and the typed ones).
A true boolean is its flag, a false one `--no-FLAG` where that exists (else nothing: off is the
default); a list is the flag's values (a repeatable flag repeated); a mapping is JSON text.
An unknown name is a ValueError naming the file and the key, before anything runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with `--config FILE` replaced by the file's flags (see the module docstring)."""
    if not argv or argv[0].startswith("-"):
        return argv
    command = argv[0]
    subparser = _subparsers(parser).get(command)
    if subparser is None or CONFIG_FLAG not in subparser._option_string_actions:
        return argv  # a command without --config: argparse judges its arguments as they are
    path, rest = _take_config_flag(argv[1:])
    if path is None:
        return argv
    return [command, *config_file_args(subparser, Path(path)), *rest]


def config_file_args(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The command-line arguments a config file stands for."""
    import yaml

    options = yaml.safe_load(path.read_text(encoding="utf-8"))
    if options is None:
        return []
    if not isinstance(options, dict):
        raise ValueError(f"{path}: a config file must be a mapping of flag names to values")
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + str(key).removeprefix("--").replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None or flag == CONFIG_FLAG:
            raise ValueError(f"{path}: unknown option {key!r} (no flag {flag})")
        args += _flag_args(parser, flag, action, value, path)
    return args


def _flag_args(parser: argparse.ArgumentParser, flag: str, action: argparse.Action,
               value: Any, path: Path) -> list[str]:
    if isinstance(value, bool):
        negative = "--no-" + flag.removeprefix("--")
        if value:
            return [flag] if action.nargs == 0 else [flag, "true"]
        return [negative] if negative in parser._option_string_actions else []
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [part for item in value for part in (flag, _text(item))]
        if action.nargs in ("+", "*"):
            return [flag, *map(_text, value)]
        raise ValueError(f"{path}: {flag} takes one value, not a list")
    return [flag, _text(value)]


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _take_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    """(the `--config` value, the other arguments); (None, args) without one."""
    for index, arg in enumerate(args):
        if arg == "--":  # what follows is positional, never a flag
            break
        if arg == CONFIG_FLAG:
            if index + 1 >= len(args):
                raise ValueError(f"{CONFIG_FLAG} needs a file")
            return args[index + 1], args[:index] + args[index + 2:]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.split("=", 1)[1], args[:index] + args[index + 1:]
    return None, args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}
