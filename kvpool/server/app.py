"""`build_app(engine, config)`: the FastAPI application around a running `AsyncLLMEngine`.

Request path: AuthMiddleware (401 before any work) → BodyLimitMiddleware (413) → FastAPI
(validation errors become 400s, Anthropic-shaped on /v1/messages) → routes (generation:
routes.py and, for Anthropic's Messages API, messages_routes.py; models,
tokenize, version, ping: utility_routes.py; KV snapshot, prefix explanation and the dashboard:
kv_routes.py; KV events' source and snapshot: kv_event_routes.py). On shutdown (the
lifespan's end) the engine is given what is left of the grace period, then stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

import kvpool
from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.openai.errors import install_error_handlers
from kvpool.openai.middleware import AccessPolicy, AuthMiddleware, BodyLimitMiddleware
from kvpool.server import messages_routes
from kvpool.server.config import ServerConfig
from kvpool.server.cors import install_cors
from kvpool.server.generation import ServerState
from kvpool.server.input_work import InputWork
from kvpool.server.kv_event_routes import router as kv_event_router
from kvpool.server.kv_routes import router as kv_router
from kvpool.server.metrics import ServerMetrics
from kvpool.server.responses_api_routes import router as responses_api_router
from kvpool.server.routes import router
from kvpool.server.tokenizer_info import router as tokenizer_info_router
from kvpool.server.utility_routes import router as utility_router


def build_app(engine: AsyncLLMEngine, config: ServerConfig | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `engine`; the app's state is `app.state.kvpool`."""
    config = config or ServerConfig()
    state = ServerState(engine, config, ServerMetrics(engine, config.model_name),
                        InputWork(engine, config))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.begin_shutdown()
        elapsed = time.monotonic() - (state.shutdown_started_at or time.monotonic())
        grace = max(0.0, config.shutdown_grace_seconds - elapsed)
        await asyncio.to_thread(engine.shutdown, grace)
        state.input_work.close()

    app = FastAPI(
        title="kvpool",
        summary="OpenAI-compatible LLM server on a paged KV-cache pool",
        version=kvpool.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.kvpool = state
    install_error_handlers(app, messages_routes.ERROR_SHAPE)
    app.include_router(router)
    app.include_router(messages_routes.router)
    app.include_router(responses_api_router)
    app.include_router(utility_router)
    app.include_router(kv_router)
    app.include_router(kv_event_router)
    if config.enable_tokenizer_info_endpoint:
        app.include_router(tokenizer_info_router)
    # Added last = runs first: authentication before the body is even read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    policy = AccessPolicy(config.api_keys, config.metrics_api_keys,
                          config.allow_unauthenticated_metrics, config.admin_api_keys)
    app.add_middleware(AuthMiddleware, policy=policy)
    install_cors(app, config.cors)  # outermost: a preflight is answered before auth's 401
    _drop_422_from_openapi(app)
    return app


def _drop_422_from_openapi(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; this server answers 400 instead (errors.py)."""
    build_schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build_schema()
            for path_item in schema["paths"].values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
