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

That is the `PASS_THROUGH` hop. `exchange` runs other `Hop`s the same way: a prefill hop
(`kvpool.router.disagg_forward`) reads its answer whole within the attempt (a client leaving
meanwhile still cancels it), counts a 5xx like a refusal (tried once on another replica, which
is not taken out), and answers 502 rather than 503 when no other replica is left to try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
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
_WHOLE_DROPPED = _RESPONSE_DROPPED | {b"content-length", b"content-encoding"}
# Failures that mean the replica never started answering (the request is safe to resend).
_NOT_STARTED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                httpx.RemoteProtocolError)
_NUM_ATTEMPTS = 2


class ClientGone(Exception):
    """The client disconnected before the replica answered."""


@dataclass(frozen=True, slots=True)
class Hop:
    """How the proxy runs one kind of exchange: the client's own request (`PASS_THROUGH`),
    or a hop whose answer is the router's to read (a prefill, `kvpool.router.disagg_forward`)."""

    noun: str  # what the replica is called in errors
    is_whole: bool  # the answer is read whole within the attempt (else streamed on after)
    is_5xx_retried: bool  # a 5xx answer is a failure before answering, as a refusal is
    is_502_when_alone: bool  # a failure with no other replica in is 502, not 503 (wait)


PASS_THROUGH = Hop("replica", is_whole=False, is_5xx_retried=False, is_502_when_alone=False)


@dataclass(frozen=True, slots=True)
class Exchange:
    replica: Replica
    upstream: httpx.Response  # its status and headers; its body read, for a whole hop


class Proxy:
    def __init__(self, client: httpx.AsyncClient, replicas: ReplicaSet,
                 metrics: RouterMetrics) -> None:
        self.client = client
        self.replicas = replicas
        self.metrics = metrics

    async def forward(self, request: Request, body: bytes, choose: Choose) -> Response:
        """The replica's response to `request` (module docstring); OpenAIError 502/503/504."""
        try:
            exchange = await self.exchange(request, body, choose, PASS_THROUGH)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client has gone
        return UpstreamResponse(exchange.upstream, partial(self._ended, exchange.replica))

    async def exchange(self, request: Request, body: bytes, choose: Choose, hop: Hop
                       ) -> Exchange:
        """`body` sent as `request` to the replica `choose` picks, tried once more elsewhere
        after a failure before any answer, as `hop` says; its answer (for a whole one, already
        ended). Raises ClientGone, and OpenAIError 502/503/504."""
        excluded: list[str] = []
        while len(excluded) < _NUM_ATTEMPTS:
            replica = self._take(choose, excluded, hop)
            try:
                upstream = await self._send(replica, request, body, hop)
            except _NOT_STARTED as error:
                self._failed_before_answer(replica, error)
                excluded.append(replica.url)
                continue
            except httpx.TimeoutException as error:
                self._ended(replica, error)
                raise OpenAIError(504, f"the {hop.noun} did not answer in time") from error
            except BaseException:  # ClientGone, a cancelled route, ...: on up
                replica.num_in_flight -= 1
                raise
            if hop.is_5xx_retried and upstream.is_server_error:
                await self._answered_error(replica, upstream)
                excluded.append(replica.url)
                continue
            if hop.is_whole:
                self._ended(replica, None)  # the answer is read: the exchange is over
            return Exchange(replica, upstream)
        raise OpenAIError(502, f"{_NUM_ATTEMPTS} {hop.noun}s failed before answering")

    def _take(self, choose: Choose, excluded: Collection[str], hop: Hop) -> Replica:
        """The replica to try next, its `num_in_flight` raised; OpenAIError if none is in."""
        choice = choose(excluded)
        if choice is None and excluded and hop.is_502_when_alone:
            raise OpenAIError(502, f"the {hop.noun} failed, and no other is in")
        if choice is None:
            self.metrics.no_replica.inc()
            raise OpenAIError(503, f"no {hop.noun} is available; try again later",
                              headers={"Retry-After": "1"})
        if excluded:
            self.metrics.retries.inc()
        replica = self.replicas[choice.name]
        replica.num_in_flight += 1
        return replica

    async def _send(self, replica: Replica, request: Request, body: bytes, hop: Hop
                    ) -> httpx.Response:
        """The replica's status and headers (its body still to come, or read too for a whole
        hop); ClientGone if the client leaves first."""
        headers = [(key, value) for key, value in request.headers.raw
                   if key.lower() not in _REQUEST_DROPPED]
        query = request.url.query
        url = replica.url + request.url.path + (f"?{query}" if query else "")
        upstream_request = self.client.build_request(request.method, url, headers=headers,
                                                     content=body)
        sending = asyncio.ensure_future(self.client.send(upstream_request,
                                                         stream=not hop.is_whole))
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

    async def _answered_error(self, replica: Replica, upstream: httpx.Response) -> None:
        """A 5xx where the hop counts it as a failure: tried elsewhere, but not taken out
        (the health checks judge the replica; one request may fail alone)."""
        replica.num_in_flight -= 1
        await upstream.aclose()
        self.metrics.upstream_errors.labels(replica.url, "status").inc()
        logger.warning("replica %s answered %d: trying another", replica.url,
                       upstream.status_code)

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


def whole_response(upstream: httpx.Response) -> Response:
    """A replica's answer read whole (`Hop.is_whole`), passed on with its status and headers
    (less the length and encoding of the body httpx has decoded: the response sets its own)."""
    response = Response(upstream.content, upstream.status_code)
    response.raw_headers += [(key, value) for key, value in upstream.headers.raw
                             if key.lower() not in _WHOLE_DROPPED]
    return response


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the body has been read, so `receive` only ever
    yields `http.disconnect` now)."""
    while (await receive())["type"] != "http.disconnect":
        pass
