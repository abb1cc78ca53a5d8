"""`build_router_app(config, tokenizer)`: the router's FastAPI application.

Request path: the server's own AuthMiddleware (401 before any work; it sets the tenant the
salt is derived from) → BodyLimitMiddleware (413) → routes:

    POST /v1/completions, /v1/chat/completions   routed (`RouterState.choose`) and forwarded
                                                 (`Proxy`), streamed or not, as they come; with
                                                 prefill and decode workers, in two hops
                                                 (`forward_disaggregated`)
    GET  /v1/models                              forwarded to the least loaded replica in that
                                                 decodes
    GET  /health                                 200 while some replica of every stage is in,
                                                 else 503
    GET  /metrics                                the router's own metrics
    GET  /v1/router/replicas                     each replica's state and role (admin key, or
                                                 no keys)

Errors are the server's OpenAI-shaped ones. Lifespan: one round of health checks before the
first request (replicas that answer are in, their KV-event feeds started), then the loop; at
the end the loop stops, the feeds stop and the HTTP client closes.

The HTTP client keeps idle connections to a replica for less time than uvicorn keeps them
open (5 s), so a request never meets a connection the replica is closing at that moment (which
would look like a replica failure); it ignores proxy settings from the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvpool
from kvpool.openai.errors import OpenAIError, install_error_handlers
from kvpool.openai.middleware import AuthMiddleware, BodyLimitMiddleware
from kvpool.router.config import RouterConfig
from kvpool.router.disagg_forward import forward_disaggregated
from kvpool.router.health import HealthChecker
from kvpool.router.metrics import RouterMetrics
from kvpool.router.proxy import Proxy
from kvpool.router.replica_events import subscribe
from kvpool.router.replicas import ReplicaSet
from kvpool.router.state import RouterState

KEEPALIVE_SECONDS = 2.0  # below uvicorn's 5 s keep-alive (module docstring)

router = APIRouter()


def _state(request: Request) -> RouterState:
    return request.app.state.router


@router.post("/v1/completions")
@router.post("/v1/chat/completions")
async def generate(request: Request) -> Response:
    state = _state(request)
    body = await request.body()
    key = await asyncio.to_thread(state.prompt_key, request.url.path, body,
                                  request.state.tenant)
    if state.config.is_disaggregated:
        return await forward_disaggregated(state, request, body, key)
    return await state.proxy.forward(request, body, partial(state.choose, "both", key))


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    return await state.proxy.forward(request, b"", state.any_replica)


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    replicas = _state(request).replicas
    num_in = len(replicas.healthy())
    if num_in == 0:
        raise OpenAIError(503, "no replica is in")
    for role in ("prefill", "decode"):  # a plain replica serves both
        if not replicas.serving(role):
            raise OpenAIError(503, f"no {role} worker is in")
    return {"status": "ok", "num_replicas_in": num_in}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/router/replicas")
async def replica_status(request: Request) -> dict[str, Any]:
    if not request.state.sees_all_tenants:
        raise OpenAIError(403, "the replicas' state needs the admin key")
    state = _state(request)
    return {"policy": state.config.policy, "block_size": state.replicas.block_size,
            "replicas": [replica.status() for replica in state.replicas]}


def build_router_app(config: RouterConfig, tokenizer: Any) -> FastAPI:
    """The router over `config.roles`' replicas; `tokenizer` is the replicas' (None: text
    prompts are routed by load). Its state is `app.state.router`."""
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
        limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_SECONDS),
        trust_env=False)
    replicas = ReplicaSet(config.roles, partial(
        subscribe, admin_key=config.replica_admin_key,
        curve_secret_key_file=config.kv_events_curve_secret_key_file))
    proxy = Proxy(client, replicas, RouterMetrics(replicas))
    state = RouterState.build(config, replicas, proxy, tokenizer)
    checker = HealthChecker(replicas, client, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await checker.check_all()
        loop = asyncio.create_task(checker.run())
        try:
            yield
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
            await replicas.close()
            await client.aclose()

    app = FastAPI(title="kvpool router", version=kvpool.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.router = state
    install_error_handlers(app)
    app.include_router(router)
    # Added last = runs first: authentication before the body is even read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(AuthMiddleware, policy=config.access)
    return app
