"""The KV event routes: where this replica publishes, and the snapshot a consumer resyncs from.

    GET /v1/kv/events           {"enabled", "publisher", "endpoint", "topic", "block_size",
                                 "seq", "curve_public_key", "num_batches_published",
                                 "num_events_published", "num_batches_dropped"}
    GET /v1/kv/events/snapshot  {"seq", "block_size", "blocks": [{"hash": hex, "medium"}]}
                                 404 while events are off

The snapshot is taken on the engine thread between two steps (`call_on_engine`); the log
drains first, so `seq` is exactly the last batch whose changes `blocks` include, and a
consumer applies the batches after it (`kvpool.router.kv_event_subscriber`).
`curve_public_key` (Z85, else null) is the socket's CURVE key: a subscriber must connect with
CURVE and a key the replica lists (`kvpool.formats.kv_events_curve`). JSON encoding
runs in a worker thread.

Access: block hashes of every tenant are listed, and tenant names (the salts they are derived
from) are guessable, so with authentication on both paths take the admin key only
(`request.state.sees_all_tenants`); a tenant key gets 403.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request, Response

from kvpool.engine.async_engine import EngineClosedError
from kvpool.engine.engine import LLMEngine
from kvpool.formats.kv_events import EventSnapshot
from kvpool.openai.errors import OpenAIError
from kvpool.openai.protocol import ErrorResponse
from kvpool.server.generation import ServerState

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (401, 403, 404, 503)
}
_NO_STORE = {"Cache-Control": "no-store"}

router = APIRouter()


def _state(request: Request) -> ServerState:
    """The server's state, once the caller is known to see every tenant (else 403)."""
    if not request.state.sees_all_tenants:
        raise OpenAIError(403, "the KV event routes list every tenant's blocks: they take "
                               "the admin key (--admin-api-key)", error_type="permission_error")
    return request.app.state.kvpool


@router.get("/v1/kv/events", responses=_ERRORS)
async def kv_events(request: Request) -> dict[str, Any]:
    """Whether and where this replica publishes its KV events."""
    engine = _state(request).engine.engine
    log = engine.kv_events
    if log is None:
        return {"enabled": False, "publisher": None, "endpoint": None, "topic": None,
                "block_size": engine.kv_memory.layout.block_size, "seq": 0,
                "curve_public_key": None}
    stats = log.publisher.stats()
    return {"enabled": True, "publisher": log.publisher.name,
            "endpoint": log.publisher.endpoint, "topic": log.config.topic,
            "block_size": log.block_size, "seq": log.seq,
            "curve_public_key": log.publisher.curve_public_key,
            "num_batches_published": stats.num_batches_published,
            "num_events_published": stats.num_events_published,
            "num_batches_dropped": stats.num_batches_dropped}


@router.get("/v1/kv/events/snapshot", responses=_ERRORS)
async def kv_events_snapshot(request: Request) -> Response:
    """Every block hash the device and host prefix caches hold, as of batch `seq`."""
    engine = _state(request).engine
    log = engine.engine.kv_events
    if log is None:
        raise OpenAIError(404, "KV events are off: start the server with --kv-events-config "
                               "'{\"enable_kv_cache_events\": true}'")
    try:
        snapshot = await engine.call_on_engine(_take_snapshot)
    except EngineClosedError as error:
        raise OpenAIError(503, "the engine has shut down") from error
    body = await asyncio.to_thread(_snapshot_body, snapshot, log.block_size)
    return Response(body, media_type="application/json", headers=_NO_STORE)


def _take_snapshot(engine: LLMEngine) -> EventSnapshot:
    return engine.kv_events.snapshot()


def _snapshot_body(snapshot: EventSnapshot, block_size: int) -> bytes:
    blocks = [{"hash": block_hash.hex(), "medium": medium}
              for block_hash, medium in snapshot.blocks]
    doc = {"seq": snapshot.seq, "block_size": block_size, "blocks": blocks}
    return json.dumps(doc, separators=(",", ":")).encode()
