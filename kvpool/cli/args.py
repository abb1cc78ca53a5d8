"""The flags every engine-running command shares, defined once: engine flags with vLLM's
names (`add_engine_args` -> `engine_config_from_args`), sampling flags (`add_sampling_args` ->
`sampling_params_from_args`) and `parse_size` for byte sizes such as `512MiB`.

The engine flags are generated, one group per `EngineConfig` section, from the fields'
declarations (`kvpool.engine.config.options`): the flag is vLLM's name (the field's with '-')
plus its aliases, its default is the field's, and its help, choices and parser are the
field's metadata. Nothing here repeats a default.

vLLM's flags that kvpool has no counterpart for (`--enforce-eager`, `--trust-remote-code`,
...) are accepted in their own group, from the one table of them
(`kvpool.engine.vllm_compat`): at a neutral value with one warning, otherwise refused.

Light on purpose (no torch): commands register these flags when `kvpool --help` builds its
parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from kvpool.engine.config import OPTION_SECTIONS, SECTIONS, EngineConfig
from kvpool.engine.config.options import flag_name, flag_of, parse_json_object, parse_size
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.vllm_compat import VLLM_ARGS, VLLMArg, ignore_vllm_args

__all__ = [
    "add_engine_args",
    "add_sampling_args",
    "engine_config_from_args",
    "engine_flag_arguments",
    "parse_json_object",
    "parse_size",
    "sampling_params_from_args",
]


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add the engine flags, one group per config section; the model is `--model`, or a
    positional MODEL (as `vllm serve`)."""
    for cls in SECTIONS.values():
        group = parser.add_argument_group(cls.TITLE)
        for names, kwargs in engine_flag_arguments(cls, model_positional):
            group.add_argument(*names, **kwargs)
    _add_vllm_compat_args(parser)


def engine_flag_arguments(
    section: type, model_positional: bool = False
) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """`add_argument`'s arguments for each option of a config section, from its field."""
    hints = typing.get_type_hints(section)
    arguments = []
    for config_field in dataclasses.fields(section):
        name, flag = config_field.name, flag_of(config_field)
        kwargs: dict[str, Any] = {"default": config_field.default, "help": flag.help}
        if name == "model" and model_positional:
            arguments.append(((name,), {**kwargs, "nargs": "?"}))
            continue
        value_type = _value_type(hints[name])
        if value_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.parser is not None or value_type in (int, float):
            kwargs["type"] = flag.parser or value_type
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        if flag.metavar is not None:
            kwargs["metavar"] = flag.metavar
        if flag.nargs is not None:
            kwargs["nargs"] = flag.nargs
        names = sorted((flag_name(name), *flag.aliases), key=lambda n: n.startswith("--"))
        arguments.append((tuple(names), {**kwargs, "dest": name}))  # short ones (-tp) first
    return arguments


def _value_type(hint: Any) -> Any:
    """The type a field holds when given: `int | None` -> int."""
    if isinstance(hint, types.UnionType):
        (value_type,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return value_type
    return hint


def _add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "accepted for vLLM compatibility",
        "vLLM flags kvpool has no counterpart for: ignored, with a warning, at values that "
        "change nothing here; refused otherwise",
    )
    for arg in VLLM_ARGS:
        if arg.flag is None:
            continue
        if arg.flag is bool:
            group.add_argument(arg.flag_name, *arg.aliases, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=_compat_help(arg))
        else:
            group.add_argument(arg.flag_name, *arg.aliases, type=arg.flag, metavar="VALUE",
                               default=argparse.SUPPRESS, help=_compat_help(arg))


def _compat_help(arg: VLLMArg) -> str:
    """What a compatibility flag accepts, in the terms of a command line (no None)."""
    if arg.neutral is None:
        return f"ignored: {arg.reason}"
    values = [_spelling(arg, value) for value in arg.neutral if value is not None]
    values += ["the model"] if arg.names_model else []
    if not values:
        return f"refused: {arg.supported}"
    return f"{', '.join(values)} accepted, and ignored: {arg.reason}"


def _spelling(arg: VLLMArg, value: object) -> str:
    """A value as a command line gives it: a bool as its flag (--x / --no-x), else as text."""
    if arg.flag is bool:
        return arg.flag_name if value else "--no-" + arg.flag_name.removeprefix("--")
    return str(value)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An EngineConfig from the parsed flags (ValueError, with the field named, if invalid;
    also for a vLLM compatibility flag at a value kvpool cannot honour)."""
    ignore_vllm_args(getattr(args, "model", None), {
        arg.name: getattr(args, arg.name) for arg in VLLM_ARGS
        if arg.flag is not None and hasattr(args, arg.name)})
    return EngineConfig(**{name: getattr(args, name) for name in OPTION_SECTIONS
                           if hasattr(args, name)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("-n", type=int, default=1, help="completions per prompt")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--sampling-seed", type=int, default=None)
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        stop=args.stop,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
