"""The side channel: a ZMQ REQ/REP pair that carries engine descriptors and the lease traffic
around the bulk transfers (which go through the transfer engine).

    client (the decode engine)                          SideChannelServer (the prefill engine)
    handshake(endpoint, local) ── hello {descriptor} ──▶ check_compatible: admit to `peers`
      check_compatible(local, remote) ◀── {descriptor} ──
    check_lease(endpoint, lease, digest, pairs) ─ check ─▶ gate.check: the lease live, granted
                                                           for this prompt, pairs current
    (the client reads the blocks through the transfer engine)
    fetch_checksums(endpoint, lease, digest, pairs) ─ checksums ─▶ gate.checksums (checked
                                                                      again)
                                   ◀── {checksums} ──
    release_lease(endpoint, lease) ── release ──▶ gate.release_later

Messages are JSON objects; an answer is either the result or `{"error": text, "reason": r}`
(r a `KVTransferError` reason, raised as such by the client). Both sides check compatibility:
the client raises `IncompatibleKVError`; the server answers with its descriptor all the same
(so the client can name the mismatch) but admits only compatible peers. Block checksums are
served only through the gate (`kvpool.engine.kv_connector.producer.KVProducer`), for blocks a
live lease holds: the channel never reads a block no lease covers.

Every request uses a fresh REQ socket with LINGER 0 and waits at most `timeout_seconds`, so a
peer that is gone or stopped costs one `KVTransferError` ("timeout") and never wedges the next
request (REQ's strict send/receive alternation dies with its socket). The server's socket is
created, bound, served and closed by its own daemon thread alone; it polls, so `close` returns
within one poll interval.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import zmq

from kvpool.engine.kv_connector.errors import FAILURE_REASONS, IncompatibleKVError, KVTransferError
from kvpool.engine.kv_connector.handshake import EngineDescriptor, check_compatible

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 10.0
BIND_TIMEOUT_SECONDS = 10.0
POLL_MS = 100  # how often the server's thread looks at its stop flag


class LeaseGate(Protocol):
    """What the server asks before touching leased blocks (`KVProducer`)."""

    def check(self, lease_id: str, prompt_digest: str, pairs: Sequence[tuple[int, int]],
              now: float) -> None: ...

    def checksums(self, lease_id: str, prompt_digest: str, pairs: Sequence[tuple[int, int]],
                  now: float) -> list[int]: ...

    def release_later(self, lease_id: str) -> None: ...


class SideChannelServer:
    """Answers peers' hellos with `descriptor` and their lease requests through `gate`, on
    tcp://host:port (0: a free port)."""

    def __init__(self, descriptor: EngineDescriptor, gate: LeaseGate,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.descriptor = descriptor
        self._gate = gate
        self._peers: dict[str, EngineDescriptor] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: Exception | None = None
        self.endpoint = ""
        self._thread = threading.Thread(target=self._serve, args=(host, port), daemon=True,
                                        name="kv-side-channel")
        self._thread.start()
        if not self._bound.wait(BIND_TIMEOUT_SECONDS):
            raise KVTransferError("timeout", f"the side channel did not bind {host}:{port}")
        if self._bind_error is not None:
            raise self._bind_error

    @property
    def peers(self) -> dict[str, EngineDescriptor]:
        """Compatible peers that said hello, by engine id (a copy)."""
        with self._lock:
            return dict(self._peers)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _serve(self, host: str, port: int) -> None:
        socket = zmq.Context.instance().socket(zmq.REP)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(f"tcp://{host}:{port or '*'}")
            self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as error:
            self._bind_error = ValueError(f"the side channel cannot bind {host}:{port}: {error}")
        finally:
            self._bound.set()
        try:
            while self._bind_error is None and not self._stop.is_set():
                if socket.poll(POLL_MS):
                    socket.send(json.dumps(self._answer(socket.recv())).encode())
        finally:
            socket.close()

    def _answer(self, raw: bytes) -> dict[str, Any]:
        """The reply to one request; never raises (REP must answer every request)."""
        try:
            message = json.loads(raw)
            kind = message["type"]
            if kind == "hello":
                return self._hello(EngineDescriptor.from_wire(message["descriptor"]))
            if kind == "release":
                self._gate.release_later(str(message["lease_id"]))
                return {"released": True}
            if kind in ("check", "checksums"):
                lease = (str(message["lease_id"]), str(message["prompt_digest"]),
                         _pairs(message["blocks"]), time.monotonic())
                if kind == "check":
                    self._gate.check(*lease)
                    return {"live": True}
                return {"checksums": self._gate.checksums(*lease)}
            return {"error": f"unknown message type {kind!r}", "reason": "protocol"}
        except KVTransferError as error:
            return {"error": str(error), "reason": error.reason}
        except Exception as error:  # a malformed request is the peer's fault, not ours
            logger.warning("side channel: refused a request: %r", error)
            return {"error": repr(error), "reason": "protocol"}

    def _hello(self, peer: EngineDescriptor) -> dict[str, Any]:
        try:
            check_compatible(self.descriptor, peer)
        except IncompatibleKVError as error:
            logger.warning("side channel: not admitting engine %s: %s", peer.engine_id, error)
        else:
            with self._lock:
                self._peers[peer.engine_id] = peer
        return {"descriptor": self.descriptor.to_wire()}


def handshake(endpoint: str, local: EngineDescriptor,
              timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> EngineDescriptor:
    """Send `local` to the server at `endpoint`; its descriptor, once `check_compatible`
    admits it (IncompatibleKVError naming the first difference otherwise)."""
    answer = _request(endpoint, {"type": "hello", "descriptor": local.to_wire()},
                      timeout_seconds)
    try:
        remote = EngineDescriptor.from_wire(answer["descriptor"])
    except IncompatibleKVError:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise KVTransferError("protocol", f"{endpoint} sent a malformed descriptor: "
                                          f"{error!r}") from error
    check_compatible(local, remote)
    return remote


def check_lease(endpoint: str, lease_id: str, prompt_digest: str,
                pairs: Sequence[tuple[int, int]],
                timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> None:
    """KVTransferError ("lease") unless the server's lease, granted for the prompt of
    `prompt_digest`, holds every (block, generation)."""
    _request(endpoint, _lease_message("check", lease_id, prompt_digest, pairs),
             timeout_seconds)


def fetch_checksums(endpoint: str, lease_id: str, prompt_digest: str,
                    pairs: Sequence[tuple[int, int]],
                    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> list[int]:
    """The server's checksums of the leased blocks `pairs` (block id, generation), taken
    while the lease holds them (`kvpool.engine.kv_connector.checksums`)."""
    answer = _request(endpoint, _lease_message("checksums", lease_id, prompt_digest, pairs),
                      timeout_seconds)
    checksums = answer.get("checksums")
    if not isinstance(checksums, list) or len(checksums) != len(pairs):
        raise KVTransferError("protocol", f"{endpoint} answered {answer!r} to a request for "
                                          f"{len(pairs)} checksums")
    return checksums


def release_lease(endpoint: str, lease_id: str,
                  timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> None:
    """Tell the server its lease is done with (it ends at the server's next engine tick)."""
    _request(endpoint, {"type": "release", "lease_id": lease_id}, timeout_seconds)


def _lease_message(kind: str, lease_id: str, prompt_digest: str,
                   pairs: Sequence[tuple[int, int]]) -> dict[str, Any]:
    return {"type": kind, "lease_id": lease_id, "prompt_digest": prompt_digest,
            "blocks": [list(pair) for pair in pairs]}


def _pairs(blocks: object) -> list[tuple[int, int]]:
    if not isinstance(blocks, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p)
            for p in blocks):
        raise ValueError("blocks must be a list of [block id, generation] pairs")
    return [(p[0], p[1]) for p in blocks]


def _request(endpoint: str, message: dict[str, Any], timeout_seconds: float) -> dict[str, Any]:
    """One request and its answer on a fresh REQ socket; KVTransferError if none comes in
    time, or if the answer is an error or not JSON."""
    socket = zmq.Context.instance().socket(zmq.REQ)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, int(timeout_seconds * 1000))
        socket.connect(endpoint)
        socket.send(json.dumps(message).encode())
        if not socket.poll(int(timeout_seconds * 1000)):
            raise KVTransferError("timeout", f"no answer from {endpoint} to {message['type']} "
                                             f"within {timeout_seconds} s")
        answer = json.loads(socket.recv())
    except zmq.ZMQError as error:
        raise KVTransferError("failed", f"side channel to {endpoint}: {error}") from error
    except json.JSONDecodeError as error:
        raise KVTransferError("protocol", f"{endpoint} answered non-JSON: {error}") from error
    finally:
        socket.close()
    if not isinstance(answer, dict):
        raise KVTransferError("protocol", f"{endpoint} answered {answer!r}")
    if "error" in answer:
        reason = answer.get("reason")
        raise KVTransferError(reason if reason in FAILURE_REASONS else "protocol",
                              f"{endpoint} refused {message['type']}: {answer['error']}")
    return answer
