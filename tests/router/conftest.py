"""Router fixtures: real replicas (in-process `kvpool serve` apps over `fast_model`, KV events
on) and a real router in front of them, each on its own loopback port.

`make_replica(**engine_options)` starts a replica (leak-checked at teardown, as every server
in tests/server is); `serve_at(port)` starts one on a given port, to bring a stopped replica
back where the router expects it. `start_router(urls, **config_options)` runs the router app
in a uvicorn thread over those URLs, with the replicas' tokenizer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.setup import build_engine_parts
from kvpool.model.loaders.base import LoadedModel
from kvpool.router.app import build_router_app
from kvpool.router.config import RouterConfig
from kvpool.router.state import RouterState
from kvpool.server.app import build_app
from kvpool.server.background import BackgroundServer
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, RunningServer, serve

KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq",
             "endpoint": "tcp://127.0.0.1:*"}
REPLICA_OPTIONS = {"num_gpu_blocks": 128, "kv_events_config": KV_EVENTS}


@dataclass
class RunningRouter:
    base_url: str
    app: FastAPI

    @property
    def state(self) -> RouterState:
        return self.app.state.router

    def client(self, api_key: str = "unused") -> OpenAI:
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0,
                      timeout=60)

    def metrics(self, **headers: str) -> dict[str, float]:
        """/metrics as `name{label=value,...}` (labels sorted) -> value."""
        text = httpx.get(f"{self.base_url}/metrics", headers=headers, timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def decisions(self, **headers: str) -> dict[tuple[str, str], float]:
        """kvpool_router_requests_total as (replica, reason) -> count, zeros left out."""
        text = httpx.get(f"{self.base_url}/metrics", headers=headers, timeout=10).text
        return {(sample.labels["replica"], sample.labels["reason"]): sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "kvpool_router_requests_total" and sample.value}

    def replica_status(self, **headers: str) -> dict[str, dict[str, Any]]:
        """GET /v1/router/replicas, by url."""
        response = httpx.get(f"{self.base_url}/v1/router/replicas", headers=headers, timeout=10)
        response.raise_for_status()
        return {replica["url"]: replica for replica in response.json()["replicas"]}


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.02)


def wait_for_blocks(router: RunningRouter, url: str, num_blocks: int) -> None:
    """Until the router's index of `url` holds at least `num_blocks` blocks."""
    def has_them() -> bool:
        events = router.state.replicas[url].events
        return events is not None and len(events.index) >= num_blocks
    wait_until(has_them, what=f"{num_blocks} indexed blocks of {url}")


@contextmanager
def start_router(urls: list[str], tokenizer: Any, **options: Any) -> Iterator[RunningRouter]:
    config = RouterConfig(replicas=tuple(urls), **options)
    app = build_router_app(config, tokenizer)
    with BackgroundServer(app) as background:
        yield RunningRouter(background.base_url, app)


@pytest.fixture
def make_replica(fast_model: LoadedModel) -> Iterator[Callable[..., RunningServer]]:
    """`make_replica(server_config=None, **engine_options)`: a replica with KV events on."""
    with ExitStack() as stack:

        def start(server_config: ServerConfig | None = None, **options: Any) -> RunningServer:
            return stack.enter_context(
                serve(fast_model, server_config, **{**REPLICA_OPTIONS, **options}))

        yield start


@contextmanager
def serve_at(loaded: LoadedModel, port: int) -> Iterator[RunningServer]:
    """A replica like `make_replica`'s on `port` (uvicorn in a thread; stopped at exit)."""
    config = EngineConfig(enable_warmup=False, **REPLICA_OPTIONS)
    engine = AsyncLLMEngine(LLMEngine(config, build_engine_parts(config, loaded)))
    app = build_app(engine, ServerConfig(served_model_names=(MODEL,)))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, what="the replica to start")
        yield RunningServer(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        thread.join()
        listener.close()
