"""`kvpool serve`'s flags that vLLM's `vllm serve` has beyond the engine's: the model as a
flag (`--model`, besides the positional MODEL), `--config` (a YAML file of flags:
`kvpool.cli.config_file`), CORS (`--allowed-origins`, `--allowed-methods`,
`--allowed-headers`, `--allow-credentials`: `kvpool.server.cors`), `--max-logprobs` and
`--enable-tokenizer-info-endpoint`. (`--uvicorn-log-level` is an alias of `--log-level`.)

Lists take vLLM's JSON form (`--allowed-origins '["https://app.example"]'`) or plain
values (`--allowed-origins https://a https://b`).
"""

from __future__ import annotations

import argparse
import json

from kvpool.server.cors import WILDCARD, CorsConfig


def add_vllm_serve_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the model, as a flag (vLLM accepts both); the positional MODEL "
                            "and --model may not disagree")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="a YAML file of flag: value lines (vLLM's); flags typed on the "
                            "command line win over the file's")
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"),
                       ("headers", "request headers")):
        group.add_argument(f"--allowed-{name}", nargs="+", default=list(WILDCARD),
                           help=f"CORS: {what} browsers may use across origins (default *)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: let browsers send credentials (needs named origins)")
    group.add_argument("--max-logprobs", type=int, default=20,
                       help="largest logprobs / top_logprobs / prompt_logprobs a request may "
                            "ask for; more get 400 (default 20, as vLLM)")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info (the tokenizer's configuration)")


def resolve_model(args: argparse.Namespace) -> None:
    """Set `args.model` from the positional MODEL or `--model`; ValueError if they differ."""
    flag = getattr(args, "model_flag", None)
    if flag is not None and args.model is not None and flag != args.model:
        raise ValueError(f"the model is given twice, as MODEL {args.model!r} and as --model "
                         f"{flag!r}: give one")
    args.model = args.model or flag


def cors_config_from_args(args: argparse.Namespace) -> CorsConfig:
    return CorsConfig(
        allowed_origins=_values(args.allowed_origins),
        allowed_methods=_values(args.allowed_methods),
        allowed_headers=_values(args.allowed_headers),
        allow_credentials=args.allow_credentials,
    )


def _values(given: list[str]) -> tuple[str, ...]:
    """Plain values, or one JSON list (vLLM's spelling), as a tuple."""
    values: list[str] = []
    for value in given:
        if value.startswith("["):
            try:
                values += [str(item) for item in json.loads(value)]
            except json.JSONDecodeError as error:
                raise ValueError(f"not a JSON list: {value!r}") from error
        else:
            values.append(value)
    return tuple(values)
