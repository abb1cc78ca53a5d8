"""The side channel: a ZMQ REQ/REP pair that carries engine descriptors and block checksums,
the small messages around the bulk transfers that go through the transfer engine.

    client (e.g. the decode engine)                 SideChannelServer (e.g. the prefill engine)
    handshake(endpoint, local) ── hello {descriptor} ──▶ check_compatible: admit to `peers`
      check_compatible(local, remote) ◀── {descriptor} ──
    fetch_checksums(endpoint, ids) ── checksums {block_ids} ──▶ block_checksums(its KV, ids)
                                   ◀── {checksums} ──

Messages are JSON objects; an answer is either the result or `{"error": text}`. Both sides check
compatibility: the client raises `IncompatibleKVError`; the server answers with its descriptor
all the same (so the client can name the mismatch) but admits only compatible peers.

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
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from kvpool.engine.kv_connector.checksums import block_checksums
from kvpool.engine.kv_connector.errors import IncompatibleKVError, KVTransferError
from kvpool.engine.kv_connector.handshake import EngineDescriptor, check_compatible

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 10.0
BIND_TIMEOUT_SECONDS = 10.0
POLL_MS = 100  # how often the server's thread looks at its stop flag


class SideChannelServer:
    """Answers peers' hellos with `descriptor` and their checksum requests over `tensors`
    (this engine's registered KV, block-major) on tcp://host:port (0: a free port)."""

    def __init__(self, descriptor: EngineDescriptor, tensors: Sequence[torch.Tensor],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.descriptor = descriptor
        self._tensors = tuple(tensors)
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
            if message["type"] == "hello":
                return self._hello(EngineDescriptor.from_wire(message["descriptor"]))
            if message["type"] == "checksums":
                return {"checksums": self._checksums(message["block_ids"])}
            return {"error": f"unknown message type {message['type']!r}"}
        except Exception as error:  # a malformed request is the peer's fault, not ours
            logger.warning("side channel: refused a request: %r", error)
            return {"error": repr(error)}

    def _hello(self, peer: EngineDescriptor) -> dict[str, Any]:
        try:
            check_compatible(self.descriptor, peer)
        except IncompatibleKVError as error:
            logger.warning("side channel: not admitting engine %s: %s", peer.engine_id, error)
        else:
            with self._lock:
                self._peers[peer.engine_id] = peer
        return {"descriptor": self.descriptor.to_wire()}

    def _checksums(self, block_ids: list[int]) -> list[int]:
        num_blocks = self.descriptor.num_blocks
        bad = [block_id for block_id in block_ids if not 0 <= block_id < num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} are outside 0..{num_blocks - 1}")
        return block_checksums(self._tensors, block_ids)


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


def fetch_checksums(endpoint: str, block_ids: Sequence[int],
                    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> list[int]:
    """The server's checksums of its blocks `block_ids` (`kvpool.engine.kv_connector.checksums`)."""
    answer = _request(endpoint, {"type": "checksums", "block_ids": list(block_ids)},
                      timeout_seconds)
    checksums = answer.get("checksums")
    if not isinstance(checksums, list) or len(checksums) != len(block_ids):
        raise KVTransferError("protocol", f"{endpoint} answered {answer!r} to a request for "
                                          f"{len(block_ids)} checksums")
    return checksums


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
        raise KVTransferError("protocol", f"{endpoint} refused {message['type']}: "
                                          f"{answer['error']}")
    return answer
