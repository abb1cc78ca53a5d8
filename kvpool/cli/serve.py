"""`kvpool serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

This module owns the command: the server flags, `server_config_from_args`, and starting the
engine and the app (`kvpool.server.app.build_app`) under `GracefulServer`.

SIGTERM or Ctrl-C starts a graceful shutdown: new generation requests get 503 at once, requests
in flight may finish for `--shutdown-grace-seconds`, whatever is left is then aborted, the engine
thread is joined and the process exits 0. A second Ctrl-C forces an immediate exit.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvpool.cli.args import add_engine_args, engine_config_from_args, parse_size

if TYPE_CHECKING:
    from kvpool.server.config import ServerConfig

DEFAULT_PORT = 8000


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
    group.add_argument("--api-key", default=None, help="require this key (tenant 'default')")
    group.add_argument(
        "--api-key-file", default=None, help="file of 'tenant:key' lines, one per line"
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
        "--shutdown-grace-seconds", type=float, default=30.0,
        help="on SIGTERM/Ctrl-C, how long in-flight requests may still run",
    )
    group.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    parser.set_defaults(func=run)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    from kvpool.server.auth import ApiKeyTable
    from kvpool.server.config import DEFAULT_MODEL_NAME, ServerConfig

    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    return ServerConfig(
        served_model_names=tuple(names),
        api_keys=ApiKeyTable.from_config(args.api_key, args.api_key_file),
        max_concurrent_requests=args.max_concurrent_requests or None,
        max_queued_sequences=args.max_queued_sequences or None,
        max_request_bytes=args.max_request_bytes,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvpool.engine.async_engine import AsyncLLMEngine
    from kvpool.engine.engine import LLMEngine
    from kvpool.server.app import build_app
    from kvpool.server.graceful import GracefulServer

    try:
        server_config = server_config_from_args(args)
        engine_config = engine_config_from_args(args)
    except (ValueError, OSError) as error:
        print(f"kvpool serve: {error}", file=sys.stderr)
        return 2
    engine = AsyncLLMEngine(LLMEngine(engine_config))
    app = build_app(engine, server_config)
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(1, round(server_config.shutdown_grace_seconds)),
    )
    server = GracefulServer(uvicorn_config, on_shutdown=app.state.kvpool.begin_shutdown)
    server.run()
    return 0
