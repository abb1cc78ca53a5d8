"""`kvpool router --replica URL [--replica URL ...]`: the prefix-aware OpenAI-compatible front
(`kvpool.router`), on uvicorn. `kvpool router --prefill URL ... --decode URL ...` instead:
disaggregated, each request prefilled on a prefill worker and decoded on a decode worker
(`kvpool.router.disagg_forward`); the two forms exclude each other, and --prefill and --decode
come together (an argparse error otherwise, before anything starts).

Keys are `kvpool serve`'s, with the same flags and the same environment fallback for
`--api-key`: give the router the replicas' key file and it knows the same tenants.
`--replica-admin-key` (or `$KVPOOL_REPLICA_ADMIN_KEY`) is the replicas' `--admin-api-key`,
used only to read their KV events. `--cache-salt-secret-file` (or `$KVPOOL_CACHE_SALT_SECRET`)
is the replicas' salt secret: without the same secret the router's block hashes miss theirs.
`--model` and `--chat-template` must name what the replicas serve: the router tokenizes
prompts as they do (only the tokenizer is loaded, not the weights).
The routing and health flags left out take `RouterConfig`'s defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import TYPE_CHECKING

from kvpool.cli.args import parse_size
from kvpool.cli.serve import LOG_LEVELS
from kvpool.router.policy import POLICIES

if TYPE_CHECKING:
    from kvpool.router.config import RouterConfig

DEFAULT_PORT = 8080
REPLICA_ADMIN_KEY_ENV_VAR = "KVPOOL_REPLICA_ADMIN_KEY"
# Flags whose default is RouterConfig's: flag dest -> RouterConfig field.
_CONFIG_FLAGS = {
    "max_load_imbalance": "max_load_imbalance",
    "health_check_interval": "health_check_interval",
    "health_check_timeout": "health_check_timeout",
    "health_check_failures": "num_failures_to_remove",
    "connect_timeout": "connect_timeout",
    "read_timeout": "read_timeout",
    "max_request_bytes": "max_request_bytes",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router", help="route OpenAI requests to the replica holding the longest prefix")
    _add_replica_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--policy", default="prefix", choices=POLICIES,
                        help="prefix (default): the longest cached prefix, load-capped; "
                             "round-robin: the replicas in turn")
    parser.add_argument("--max-load-imbalance", type=int, metavar="N",
                        help="requests in flight a replica may have beyond the least loaded "
                             "one and still be chosen for its prefix")
    parser.add_argument("--model", default=None,
                        help="the replicas' model, for its tokenizer (default: SmolLM2)")
    parser.add_argument("--chat-template", default=None,
                        help="the replicas' --chat-template, if they have one")
    _add_key_args(parser)
    _add_timing_args(parser)
    parser.add_argument("--max-request-bytes", type=parse_size, metavar="SIZE",
                        help="larger request bodies get 413 (default: kvpool serve's)")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    parser.set_defaults(func=partial(run, parser))


def _add_replica_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "replicas (--replica, or --prefill with --decode for disaggregated serving)")
    group.add_argument("--replica", action="append", metavar="URL",
                       help="a replica's base URL (http://host:port); repeat for each")
    group.add_argument("--prefill", action="append", metavar="URL",
                       help="a prefill worker's base URL: it computes each prompt (chosen by "
                            "the longest cached prefix); repeat for each")
    group.add_argument("--decode", action="append", metavar="URL",
                       help="a decode worker's base URL: it generates from the prefill's KV "
                            "blocks (chosen by least load); repeat for each")


def check_replica_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with an argparse error unless the flags give --replica, or --prefill with
    --decode."""
    if args.replica and (args.prefill or args.decode):
        parser.error("argument --prefill/--decode: not allowed with argument --replica")
    if bool(args.prefill) != bool(args.decode):
        given, missing = ("--prefill", "--decode") if args.prefill else ("--decode", "--prefill")
        parser.error(f"argument {given}: needs {missing} too (disaggregated serving takes "
                     "prefill and decode workers)")
    if not (args.replica or args.prefill):
        parser.error("one of the arguments --replica or --prefill/--decode is required")


def _add_key_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("keys (as kvpool serve takes them)")
    group.add_argument("--api-key", action="append", default=None,
                       help="require this key (tenant 'default'); repeat for several. "
                            "Default: $KVPOOL_API_KEY, else $VLLM_API_KEY")
    group.add_argument("--api-key-file", default=None, help="file of 'tenant:key' lines")
    group.add_argument("--metrics-api-key", default=None, help="a key for /metrics only")
    group.add_argument("--admin-api-key", action="append", default=None,
                       help="an operator's key (tenant 'admin'), as the replicas have it")
    group.add_argument("--allow-unauthenticated-metrics", action="store_true",
                       help="serve /metrics without a key even when the other routes need one")
    group.add_argument("--replica-admin-key", default=None,
                       help="the replicas' --admin-api-key, to read their KV events "
                            f"(default: ${REPLICA_ADMIN_KEY_ENV_VAR})")
    group.add_argument("--cache-salt-secret-file", default=None, metavar="FILE",
                       help="the replicas' --cache-salt-secret-file, so prompts hash as they do "
                            "(default: $KVPOOL_CACHE_SALT_SECRET, else ~/.cache/kvpool's file)")
    group.add_argument("--kv-events-curve-secret-key-file", default=None, metavar="FILE",
                       help="the router's ZMQ CURVE key pair, for replicas whose KV event "
                            "socket requires CURVE (their curve_client_keys list its public key)")


def _add_timing_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("health and timeouts")
    group.add_argument("--health-check-interval", type=float, metavar="SECONDS")
    group.add_argument("--health-check-timeout", type=float, metavar="SECONDS")
    group.add_argument("--health-check-failures", type=int, metavar="N",
                       help="failed checks in a row that take a replica out")
    group.add_argument("--connect-timeout", type=float, metavar="SECONDS")
    group.add_argument("--read-timeout", type=float, metavar="SECONDS",
                       help="the longest wait for a replica's next byte (0: no limit)")


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    from kvpool.cli.serve import api_keys_from_args, load_chat_template
    from kvpool.openai.auth import ADMIN_TENANT, METRICS_TENANT, ApiKeyTable, TenantSalts
    from kvpool.openai.middleware import AccessPolicy
    from kvpool.router.config import RouterConfig

    metrics_keys = [(METRICS_TENANT, args.metrics_api_key)] if args.metrics_api_key else []
    access = AccessPolicy(
        keys=ApiKeyTable.from_config(api_keys_from_args(args), args.api_key_file),
        metrics_keys=ApiKeyTable.from_keys(metrics_keys),
        is_metrics_open=args.allow_unauthenticated_metrics,
        admin_keys=ApiKeyTable.from_keys([(ADMIN_TENANT, key)
                                          for key in args.admin_api_key or ()]))
    given = {name: getattr(args, flag) for flag, name in _CONFIG_FLAGS.items()
             if getattr(args, flag) is not None}
    if given.get("read_timeout") == 0:
        given["read_timeout"] = None
    admin_key = args.replica_admin_key or os.environ.get(REPLICA_ADMIN_KEY_ENV_VAR) or None
    return RouterConfig(
        replicas=_urls(args.replica), prefill=_urls(args.prefill), decode=_urls(args.decode),
        policy=args.policy, access=access, replica_admin_key=admin_key,
        kv_events_curve_secret_key_file=args.kv_events_curve_secret_key_file,
        tenant_salts=TenantSalts.resolve(args.cache_salt_secret_file), model=args.model,
        chat_template=load_chat_template(args.chat_template), **given)


def _urls(flags: list[str] | None) -> tuple[str, ...]:
    return tuple(url.rstrip("/") for url in flags or ())


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_replica_args(parser, args)
    import uvicorn

    from kvpool.router.app import build_router_app
    from kvpool.router.prompt_tokens import load_tokenizer

    try:
        config = router_config_from_args(args)
        tokenizer = load_tokenizer(config.model) if config.policy == "prefix" else None
    except (ValueError, OSError) as error:
        print(f"kvpool router: {error}", file=sys.stderr)
        return 2
    app = build_router_app(config, tokenizer)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
