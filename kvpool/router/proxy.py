"""Forwarding a request to a replica and its answer back, byte for byte, with one retry.

    choose(excluded)      the replica to try (a routing decision), or None: 503
    send                  the client's method, path, query, headers (its Authorization
                          included) and body; done when the replica's status line and headers
                          arrive, or the client leaves first (the send is cancelled: the
                          replica sees the connection close and aborts the request)
      refused / reset /   before any byte came back: the replica is taken out, and the request
      closed              is tried once more on another replica (`kvpool_router_retries_total`);
                          a second failure answers 502
      timeout             504, no retry (the replica may still be working on it)
    UpstreamResponse      status and headers as the replica sent them (less hop-by-hop ones),
                          then the body as it arrives: a server-sent event stream passes through
                          chunk by chunk, a whole JSON response at once. After the first byte
                          nothing is retried; a replica that breaks off mid-body breaks off the
                          client's response too (the connection is closed, so the client sees
                          it truncated, never a complete-looking answer).

A client that disconnects at any point closes the upstream response, which the replica sees as
its client disconnecting (it aborts the request and frees its blocks). `num_in_flight` of the
chosen replica is raised before the send and lowered exactly once when its exchange ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from functools import partial

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvpool.openai.errors import OpenAIError
from kvpool.router.metrics import RouterMetrics
from kvpool.router.policy import Choice
from kvpool.router.replicas import Replica, ReplicaSet

logger = logging.getLogger(__name__)

Choose = Callable[[Collection[str]], Choice | None]  # excluded replica urls -> a decision

# Hop-by-hop headers (RFC 9110 7.6.1) and those httpx or uvicorn set themselves.
_REQUEST_DROPPED = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
_RESPONSE_DROPPED = _REQUEST_DROPPED - {b"content-length"} | {b"date", b"server"}
# Failures that mean the replica never started answering (the request is safe to resend).
_NOT_STARTED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                httpx.RemoteProtocolError)
_NUM_ATTEMPTS = 2


class ClientGone(Exception):
    """The client disconnected before the replica answered."""


class Proxy:
    def __init__(self, client: httpx.AsyncClient, replicas: ReplicaSet,
                 metrics: RouterMetrics) -> None:
        self.client = client
        self.replicas = replicas
        self.metrics = metrics

    async def forward(self, request: Request, body: bytes, choose: Choose) -> Response:
        """The replica's response to `request` (module docstring); OpenAIError 502/503/504."""
        excluded: list[str] = []
        while len(excluded) < _NUM_ATTEMPTS:
            choice = choose(excluded)
            if choice is None:
                self.metrics.no_replica.inc()
                raise OpenAIError(503, "no replica is available; try again later",
                                  headers={"Retry-After": "1"})
            if excluded:
                self.metrics.retries.inc()
            replica = self.replicas[choice.name]
            replica.num_in_flight += 1
            try:
                upstream = await self._send(replica, request, body)
            except _NOT_STARTED as error:
                self._failed_before_answer(replica, error)
                excluded.append(replica.url)
                continue
            except httpx.TimeoutException as error:
                self._ended(replica, error)
                raise OpenAIError(504, "the replica did not answer in time") from error
            except ClientGone:
                replica.num_in_flight -= 1
                return Response(status_code=499)  # nobody reads it: the client has gone
            except BaseException:  # anything else (a cancelled route included) goes on up
                replica.num_in_flight -= 1
                raise
            return UpstreamResponse(upstream, partial(self._ended, replica))
        raise OpenAIError(502, f"{_NUM_ATTEMPTS} replicas failed before answering")

    async def _send(self, replica: Replica, request: Request, body: bytes) -> httpx.Response:
        """The replica's status and headers (its body still to come); ClientGone if the
        client leaves first."""
        headers = [(key, value) for key, value in request.headers.raw
                   if key.lower() not in _REQUEST_DROPPED]
        query = request.url.query
        url = replica.url + request.url.path + (f"?{query}" if query else "")
        upstream_request = self.client.build_request(request.method, url, headers=headers,
                                                     content=body)
        sending = asyncio.ensure_future(self.client.send(upstream_request, stream=True))
        watching = asyncio.ensure_future(wait_for_disconnect(request.receive))
        try:
            await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            sending.cancel()
            raise
        finally:
            watching.cancel()
        if not sending.done():
            sending.cancel()  # closes the connection: the replica aborts the request
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await sending
            raise ClientGone
        return sending.result()

    def _failed_before_answer(self, replica: Replica, error: Exception) -> None:
        replica.num_in_flight -= 1
        self.metrics.upstream_errors.labels(replica.url, "connect").inc()
        self.replicas.take_out(replica, f"{type(error).__name__} before any answer")

    def _ended(self, replica: Replica, error: Exception | None) -> None:
        replica.num_in_flight -= 1
        if error is None:
            return
        kind = "timeout" if isinstance(error, httpx.TimeoutException) else "stream"
        self.metrics.upstream_errors.labels(replica.url, kind).inc()
        if kind == "stream":
            self.replicas.take_out(replica, f"{type(error).__name__} while answering")


class UpstreamResponse(Response):
    """A replica's streamed response, passed through (module docstring). `on_end` is called
    once, when the exchange ends, with the replica's error if it broke off."""

    def __init__(self, upstream: httpx.Response,
                 on_end: Callable[[Exception | None], None]) -> None:
        self.upstream = upstream
        self.on_end = on_end
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [(key, value) for key, value in upstream.headers.raw
                            if key.lower() not in _RESPONSE_DROPPED]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error: Exception | None = None
        try:
            async with anyio.create_task_group() as group:

                async def pump() -> None:
                    nonlocal error
                    error = await self._pump(send)
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(pump)
                group.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.on_end(error)
        if self.background is not None:  # FastAPI may attach a route's background tasks
            await self.background()

    async def _pump(self, send: Send) -> Exception | None:
        """Send the replica's response on; the replica's error if it broke off. Then the
        client's response is left unfinished, and uvicorn closes its connection."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as error:
            logger.warning("the replica broke off its response: %s", type(error).__name__)
            return error
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the body has been read, so `receive` only ever
    yields `http.disconnect` now)."""
    while (await receive())["type"] != "http.disconnect":
        pass
