"""`FakeWorker`: a scripted stand-in for a prefill or decode worker, served over real HTTP on a
free loopback port (`kvpool.server.background.BackgroundServer`, as the router tests serve
their replicas), for the disaggregated router's tests.

It records every generation request it receives (path, raw body, headers) and answers as its
script says:
- a prefill worker: `status` (an OpenAI-shaped error unless 200), else a whole completion whose
  top-level `kv_transfer_params` is `params` (`OMITTED`: the field left out);
- a decode worker: a whole completion or chat completion naming the worker, or, for a request
  with `"stream": true`, server-sent events of `pieces` in order; with `lockstep`, each piece
  after the first waits until the test calls `ack()` for the one before (so a stream that
  arrives at all arrived chunk by chunk);
- `is_held`: it answers nothing and waits until its client disconnects (`disconnected`).
A worker made with `publishes_events` serves KV events as a replica does (`GET /v1/kv/events`
and its snapshot, a ZMQ publisher); `store(block_hashes)` publishes the blocks it holds.
`/health` answers 200, `/v1/models` names the worker.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.formats.kv_events import DEVICE, BlockStored, KVEventBatch, encode_message
from kvpool.server.background import BackgroundServer

OMITTED = object()  # a prefill answer without the kv_transfer_params field
BLOCK_SIZE = 16
ACK_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class Received:
    path: str
    raw: bytes
    headers: dict[str, str]

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


@dataclass
class FakeWorker:
    name: str
    status: int = 200
    params: Any = None  # a prefill's kv_transfer_params (OMITTED: left out)
    pieces: Sequence[str] = ("Hello", ",", " sea", "!")
    lockstep: bool = False
    is_held: bool = False
    publishes_events: bool = False
    received: list[Received] = field(default_factory=list)
    disconnected: threading.Event = field(default_factory=threading.Event)
    _acks: queue.Queue = field(default_factory=queue.Queue)
    url: str = ""  # set by start, kept after stop (its port then refuses connections)
    _server: BackgroundServer | None = None
    _events: _EventFeed | None = None

    def start(self) -> FakeWorker:
        if self.publishes_events:
            self._events = _EventFeed()
        self._server = BackgroundServer(self._app()).start()
        self.url = self._server.base_url
        return self

    def stop(self) -> None:
        """Stop serving: its port refuses connections from now on."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._events is not None:
            self._events.close()
            self._events = None

    def ack(self) -> None:
        """Let a lockstep stream send its next piece."""
        self._acks.put(None)

    def store(self, block_hashes: Sequence[bytes]) -> None:
        """Publish that it now holds `block_hashes` (a BlockStored batch)."""
        assert self._events is not None
        self._events.store(block_hashes)

    def _app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", lambda request: JSONResponse({})),
            Route("/v1/models", self._models),
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/kv/events", self._event_source),
            Route("/v1/kv/events/snapshot", self._snapshot),
        ])

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": 0, "owned_by": "fake"}]})

    async def _generate(self, request: Request) -> Response:
        raw = await request.body()
        self.received.append(Received(request.url.path, raw, dict(request.headers)))
        if self.is_held:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
            return Response(status_code=499)
        if self.status != 200:
            return JSONResponse(_error(self.status), status_code=self.status)
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse(_error(400), status_code=400)
        if body.get("stream"):
            return StreamingResponse(self._stream(request.url.path),
                                     media_type="text/event-stream")
        return JSONResponse(self._whole(request.url.path))

    def _whole(self, path: str) -> dict[str, Any]:
        text = "".join(self.pieces)
        answer = ({"object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text},
            "finish_reason": "stop"}]} if path.endswith("chat/completions") else
            {"object": "text_completion", "choices": [{
                "index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}]})
        answer.update(id=f"{self.name}-1", created=0, model=self.name, usage={
            "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
        if self.params is not OMITTED:
            answer["kv_transfer_params"] = self.params
        return answer

    async def _stream(self, path: str) -> AsyncIterator[bytes]:
        is_chat = path.endswith("chat/completions")
        for number, piece in enumerate(self.pieces):
            if number and self.lockstep:
                await asyncio.to_thread(self._acks.get, True, ACK_TIMEOUT_SECONDS)
            choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None}
                      if is_chat else {"index": 0, "text": piece, "finish_reason": None})
            chunk = {"id": f"{self.name}-1", "created": 0, "model": self.name,
                     "object": "chat.completion.chunk" if is_chat else "text_completion",
                     "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def _event_source(self, request: Request) -> Response:
        if self._events is None:
            return JSONResponse({"detail": "no events"}, status_code=404)
        return JSONResponse({"enabled": True, "publisher": "zmq", "topic": "",
                             "endpoint": self._events.endpoint, "block_size": BLOCK_SIZE})

    async def _snapshot(self, request: Request) -> Response:
        assert self._events is not None
        seq, held = self._events.snapshot()
        return JSONResponse({"seq": seq, "block_size": BLOCK_SIZE, "blocks": [
            {"hash": block_hash.hex(), "medium": DEVICE} for block_hash in held]})


class _EventFeed:
    """A replica's KV events: a ZMQ publisher, the blocks held and the last batch's seq."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._lock = threading.Lock()
        self._seq = 0
        self._held: list[bytes] = []

    def store(self, block_hashes: Sequence[bytes]) -> None:
        event = BlockStored(list(block_hashes), None, [], BLOCK_SIZE, None, DEVICE)
        with self._lock:
            self._seq += 1
            self._held.extend(block_hashes)
            batch = KVEventBatch(ts=time.time(), events=[event])
            self._socket.send_multipart(encode_message("", self._seq, batch))

    def snapshot(self) -> tuple[int, list[bytes]]:
        with self._lock:
            return self._seq, list(self._held)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def _error(status: int) -> dict[str, Any]:
    return {"error": {"message": f"scripted {status}", "type": "invalid_request_error"
                      if status < 500 else "server_error", "param": None, "code": status}}
