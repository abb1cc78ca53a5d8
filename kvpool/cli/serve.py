"""`kvpool serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

This module owns the command: the server flags, `server_config_from_args`, and starting the
engine and the app (`kvpool.server.app.build_app`) under `GracefulServer`.

SIGTERM or Ctrl-C starts a graceful shutdown: new generation requests get 503 at once, requests
in flight may finish for `--shutdown-grace-seconds`, whatever is left is then aborted, the engine
thread is joined and the process exits 0. A second Ctrl-C forces an immediate exit.

Keys: `--api-key` may repeat (every key names tenant "default"); without it, the
`KVPOOL_API_KEY` environment variable, else `VLLM_API_KEY` (as vLLM reads it), gives one.
`--metrics-api-key` is accepted on /metrics only; `--allow-unauthenticated-metrics` opens it.
`--admin-api-key` (may repeat) opens every path, generation included (as tenant "admin"), and
/metrics, and sees every tenant's requests in /v1/kv/snapshot and the /dashboard page.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.cli.args import add_engine_args, engine_config_from_args, parse_size
from kvpool.cli.serve_vllm_flags import add_vllm_serve_args, cors_config_from_args, resolve_model
from kvpool.openai.reasoning import reasoning_parser_names

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig
    from kvpool.server.config import ServerConfig

DEFAULT_PORT = 8000
API_KEY_ENV_VARS = ("KVPOOL_API_KEY", "VLLM_API_KEY")  # read in this order without --api-key
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_args(parser, model_positional=True)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT)
    group.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="names clients use in `model` (default: MODEL, or SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--api-key", action="append", default=None,
        help="require this key (tenant 'default'); repeat for several. Default: "
             "$KVPOOL_API_KEY, else $VLLM_API_KEY",
    )
    group.add_argument(
        "--api-key-file", default=None, help="file of 'tenant:key' lines, one per line"
    )
    group.add_argument(
        "--metrics-api-key", default=None,
        help="a key accepted on /metrics only (for Prometheus), besides the tenants' keys",
    )
    group.add_argument(
        "--admin-api-key", action="append", default=None,
        help="an operator's key (tenant 'admin'): accepted on every path and /metrics, and "
             "sees every tenant's requests in the KV snapshot and dashboard; may repeat",
    )
    group.add_argument(
        "--cache-salt-secret-file", default=None, metavar="FILE",
        help="the secret tenants' cache salts are keyed with (default: "
             "$KVPOOL_CACHE_SALT_SECRET, else a file generated once in the --kv-disk-cache "
             "directory or ~/.cache/kvpool); give replicas and routers sharing blocks the same",
    )
    group.add_argument(
        "--allow-unauthenticated-metrics", action="store_true",
        help="serve /metrics without a key even when the other routes need one",
    )
    group.add_argument(
        "--max-concurrent-requests", type=int, default=1024,
        help="generation requests in flight; more get 429 (0: no limit)",
    )
    group.add_argument(
        "--max-queued-sequences", type=int, default=4096,
        help="sequences (prompts x n) in flight over all requests; more get 429 (0: no limit)",
    )
    group.add_argument(
        "--max-request-bytes", type=parse_size, default="4MiB",
        help="larger request bodies get 413 (default 4MiB)",
    )
    group.add_argument(
        "--input-workers", type=int, default=4,
        help="threads that tokenize, render chat templates and compile grammars, shared by "
             "tenants in turn (default 4)",
    )
    group.add_argument(
        "--max-grammar-chars", type=int, default=131_072,
        help="longest JSON schema, regex or grammar accepted, in characters (default 131072)",
    )
    group.add_argument(
        "--grammar-compile-timeout", type=float, default=1.0,
        help="seconds a grammar may take to compile before its request gets 400 (default 1)",
    )
    group.add_argument(
        "--shutdown-grace-seconds", type=float, default=30.0,
        help="on SIGTERM/Ctrl-C, how long in-flight requests may still run",
    )
    group.add_argument(
        "--chat-template", default=None,
        help="a Jinja chat template (a file, or the template itself) replacing the model's",
    )
    group.add_argument(
        "--tool-call-parser", default="hermes",
        help="how tool calls are read from the model's output (default hermes)",
    )
    group.add_argument(
        "--reasoning-parser", default=None, choices=reasoning_parser_names(),
        help="split a reasoning model's <think>...</think> into reasoning_content "
             "(vLLM's names; default: none)",
    )
    group.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="accepted for vLLM command lines: tool_choice auto is always on",
    )
    group.add_argument(
        "--log-level", "--uvicorn-log-level", default="info", type=str.lower,
        choices=LOG_LEVELS, help="uvicorn's log level, in any case (default info)",
    )
    add_vllm_serve_args(group)
    parser.set_defaults(func=run)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    from kvpool.openai.auth import ADMIN_TENANT, METRICS_TENANT, ApiKeyTable, TenantSalts
    from kvpool.server.config import DEFAULT_MODEL_NAME, ServerConfig

    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    return ServerConfig(
        served_model_names=tuple(names),
        api_keys=ApiKeyTable.from_config(api_keys_from_args(args), args.api_key_file),
        metrics_api_keys=ApiKeyTable.from_keys(
            [(METRICS_TENANT, args.metrics_api_key)] if args.metrics_api_key is not None else []
        ),
        admin_api_keys=ApiKeyTable.from_keys(
            [(ADMIN_TENANT, key) for key in args.admin_api_key or ()]),
        allow_unauthenticated_metrics=args.allow_unauthenticated_metrics,
        max_concurrent_requests=args.max_concurrent_requests or None,
        max_queued_sequences=args.max_queued_sequences or None,
        max_request_bytes=args.max_request_bytes,
        input_workers=args.input_workers,
        max_grammar_chars=args.max_grammar_chars,
        grammar_compile_timeout=args.grammar_compile_timeout,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        chat_template=load_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        tenant_salts=TenantSalts.resolve(args.cache_salt_secret_file, args.kv_disk_cache),
        max_logprobs=args.max_logprobs,
        cors=cors_config_from_args(args),
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
    )


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template` as vLLM reads it: a file's contents, or the value itself if it looks
    like a template (braces or a newline); ValueError for a path that does not exist."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(char in value for char in "{}\n"):
        return value
    raise ValueError(f"--chat-template: no such file {value!r}")


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """The `--api-key` flags; without any, the first of `API_KEY_ENV_VARS` that is set (an
    empty variable counts as unset)."""
    if args.api_key is not None:
        return list(args.api_key)
    for name in API_KEY_ENV_VARS:
        if os.environ.get(name):
            return [os.environ[name]]
    return []


def check_kv_events_exposure(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """ValueError when the KV event socket would publish every tenant's blocks on every
    interface of a server with keys (`KVEventsConfig.check_exposure`)."""
    events = engine_config.observability.kv_events_config
    if events is not None:
        events.check_exposure(server_config.api_keys.is_enabled
                              or server_config.admin_api_keys.is_enabled)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvpool.engine.async_engine import AsyncLLMEngine
    from kvpool.engine.cpu_threads import reserve_front_end_core
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.model_loading import resolve_device
    from kvpool.server.app import build_app
    from kvpool.server.graceful import GracefulServer
    from kvpool.server.startup import log_startup_summary

    try:
        resolve_model(args)
        server_config = server_config_from_args(args)
        engine_config = engine_config_from_args(args)
        check_kv_events_exposure(engine_config, server_config)
    except (ValueError, OSError) as error:
        print(f"kvpool serve: {error}", file=sys.stderr)
        return 2
    reserve_front_end_core(engine_config.load.cpu_threads,
                           resolve_device(engine_config.load.device))
    engine = AsyncLLMEngine(LLMEngine(engine_config))
    app = build_app(engine, server_config)
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(1, round(server_config.shutdown_grace_seconds)),
    )
    log_startup_summary(engine.engine, server_config.model_name)
    server = GracefulServer(uvicorn_config, on_shutdown=app.state.kvpool.begin_shutdown)
    server.run()
    return 0
