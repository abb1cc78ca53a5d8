"""`AsyncLLMEngine`: one `LLMEngine` stepping in its own thread, fed by asyncio callers.

    event loop(s)                          engine thread (the only one touching LLMEngine)
    add_request / abort  ── commands ──▶   drain commands → step() → route outputs
    call_on_engine(fn)   ── commands ──▶   fn(engine) between steps; its result comes back
    RequestStream        ◀── outputs ───   loop.call_soon_threadsafe(queue.put_nowait, …)

The engine thread steps while any request is unfinished and sleeps on an Event when idle (no
busy spin; it wakes once a second so that an elastic KV pool can give idle memory back).
Commands travel through a thread-safe FIFO, so an abort queued after an add always finds its
request. After every iteration the thread publishes an `EngineSnapshot`, which
readers on any thread may take without locking (one reference swap).

Invariants: every request whose add succeeded gets exactly one final item on its stream, either
a finished `RequestOutput` (finished or aborted) or an `EngineError`; once `shutdown` returns the
thread has exited and no request remains in the engine. A step that raises fails every request
in flight with an `EngineError` and the loop goes on; if even aborting them fails, or the pool
does not come back empty, the engine reports itself unhealthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpool.engine.engine import EngineStats, LLMEngine, PromptInput
from kvpool.engine.kv_connector.stats import KVTransferStats
from kvpool.engine.memory_stats import MemoryStats
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.engine.requests.prompt_limits import PromptLimits
from kvpool.engine.requests.stream import RequestStream
from kvpool.engine.sampling.grammar import GrammarCompiler
from kvpool.engine.sampling_params import SamplingParams
from kvpool.formats.kv_snapshot import KVSnapshot
from kvpool.memory.kv_pool import KVPoolStats
from kvpool.memory.tiers.kv_tiers import KVTierStats

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine failed this request (a step raised), not the request's own input."""


class RequestFailedError(EngineError):
    """One request failed where others go on (its KV load, under kv_load_failure_policy
    "fail"); the message says why."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down (or its thread has died) and takes no new requests."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state between two steps, for metrics and status endpoints."""

    memory: MemoryStats
    kv_pool: KVPoolStats  # online blocks, segments, grows/shrinks (elastic pools resize)
    stats: EngineStats
    kv_tiers: KVTierStats  # the host and disk tiers: blocks, spills, reloads
    num_requests_running: int
    num_requests_waiting: int
    num_failed_steps: int
    kv_transfer: KVTransferStats | None = None  # the KV connector's (kv_transfer_config)


class AsyncLLMEngine:
    """Serve an `LLMEngine` to many concurrent asyncio callers (continuous batching)."""

    def __init__(self, engine: LLMEngine, idle_tick_seconds: float = 1.0) -> None:
        """Start the engine thread. When idle it wakes every `idle_tick_seconds` (or at once
        for a new command) to let an elastic KV pool shrink."""
        self.engine = engine
        self.idle_tick_seconds = idle_tick_seconds
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._no_requests = threading.Event()
        self._no_requests.set()
        self._streams: dict[str, RequestStream] = {}
        self._request_ids = itertools.count()
        self._is_accepting = True
        self._accept_lock = threading.Lock()
        self._is_stopping = False
        self._is_closed = False  # the thread's last drain is done: no command runs any more
        self._num_failed_steps = 0
        self._unhealthy_reason: str | None = None  # the loop's own findings
        self._snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="kvpool-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ callers' side
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (thread-safe for encode/decode and chat templates)."""
        return self.engine.tokenizer

    @property
    def prompt_limits(self) -> PromptLimits:
        """How long a prompt may be (`LLMEngine.prompt_limits`; immutable, any thread)."""
        return self.engine.prompt_limits

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """The engine's structured-outputs compiler (thread-safe; None without a tokenizer)."""
        return self.engine.grammar_compiler

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.unhealthy_reason is None

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the engine is unhealthy (the loop's findings, or the engine's own: a dead
        tensor-parallel worker), or None."""
        return self._unhealthy_reason or self.engine.unhealthy_reason

    @property
    def is_accepting(self) -> bool:
        return self._is_accepting and self._thread.is_alive()

    def snapshot(self) -> EngineSnapshot:
        """The state as of the end of the engine thread's latest iteration."""
        return self._snapshot

    async def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream; ValueError (from the engine) if it is
        invalid, EngineClosedError if the engine is shutting down. A structured request's
        grammar is compiled first, in a worker thread, so the engine thread finds it cached;
        so are its bad words tokenized. The params are checked and copied first: the caller's
        later changes to its object never reach the request."""
        loop = asyncio.get_running_loop()
        params = params.validated_copy()
        if params.bad_words:
            await asyncio.to_thread(self.engine.intake.token_rules.prepare, params)
        compiler = self.grammar_compiler
        if params.structured_outputs is not None and compiler is not None:
            await asyncio.to_thread(compiler.compile, params.structured_outputs)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        stream = RequestStream(request_id, loop, self, params.output_kind)
        added: asyncio.Future[None] = loop.create_future()
        with self._accept_lock:  # the engine thread's last drain cannot miss this command
            if not self.is_accepting:
                raise EngineClosedError("the engine is shutting down and takes no new requests")
            self._submit(lambda: self._add(stream, prompt, params, priority, cache_salt, added))
        try:
            await added
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it finds the request
            raise
        return stream

    async def call_on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` run on the engine thread between two steps (so it sees a consistent
        engine and no step runs meanwhile), its result or exception returned here. Keep `fn`
        short: every request waits while it runs. EngineClosedError once the thread is gone."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            if self._is_closed:
                _resolve(loop, done, EngineClosedError("the engine has shut down"))
                return
            try:
                result = fn(self.engine)
            except Exception as error:  # the caller's failure, not the engine's
                _resolve(loop, done, error)
                return
            _resolve(loop, done, None, result)

        with self._accept_lock:  # the engine thread's last drain cannot miss this command
            if self._is_closed or not self._thread.is_alive():
                raise EngineClosedError("the engine has shut down")
            self._submit(command)
        return await done

    async def kv_snapshot(self) -> KVSnapshot:
        """`LLMEngine.kv_snapshot()`, taken on the engine thread between steps."""
        return await self.call_on_engine(LLMEngine.kv_snapshot)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks return to the pool at the engine
        thread's next iteration (at most one step away)."""
        self._submit(lambda: self._abort(request_id))

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `grace_seconds`, abort the
        rest, and join the engine thread. Blocking: from asyncio, use `asyncio.to_thread`."""
        self._is_accepting = False
        if grace_seconds > 0:
            self._no_requests.wait(grace_seconds)
        self._submit(self._stop)
        self._thread.join()

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._is_stopping:
                self._wakeup.clear()
                self._drain_commands()
                if self._is_stopping:
                    break
                outputs: list[RequestOutput] = []
                if self.engine.has_unfinished_requests():
                    outputs = self._step()
                else:
                    self._resize_when_idle()
                # Published before the outputs: whoever sees an output sees this state or newer.
                self._snapshot = self._take_snapshot()
                self._route(outputs)
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(self.idle_tick_seconds)
        except BaseException as error:
            logger.exception("the engine thread died")
            self._unhealthy_reason = f"the engine thread died: {type(error).__name__}"
            self._fail_all(EngineError("the engine thread died"))
        finally:
            self._fail_all(EngineClosedError("the engine has shut down"))
            with self._accept_lock:
                self._is_accepting = False
                self._is_closed = True
                self._drain_commands()  # adds and calls that raced the shutdown get their answer
            self.engine.close()  # the KV tiers finish their copies and disk writes
            self._snapshot = self._take_snapshot()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                logger.exception("an engine command failed")
                self._unhealthy_reason = "an engine command raised"

    def _add(
        self,
        stream: RequestStream,
        prompt: PromptInput,
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        added: asyncio.Future[None],
    ) -> None:
        try:
            if not self._is_accepting:
                raise EngineClosedError("the engine is shutting down and takes no new requests")
            self.engine.add_request(prompt, params, stream.request_id, priority, cache_salt)
        except Exception as error:  # ValueError for bad input, delivered to the caller
            _resolve(stream.loop, added, error)
            return
        self._streams[stream.request_id] = stream
        self._no_requests.clear()
        _resolve(stream.loop, added, None)

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and output is not None:
            stream.put(output)
        self._update_no_requests()

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as error:
            logger.exception("engine step failed; failing every request in flight")
            self._num_failed_steps += 1
            self._fail_all(EngineError(f"engine step failed: {type(error).__name__}: {error}"))
            return []

    def _route(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output if output.error is None else RequestFailedError(output.error))
            if output.finished:
                del self._streams[output.request_id]
        self._update_no_requests()

    def _fail_all(self, error: BaseException) -> None:
        """Abort every request in the engine and hand `error` to its stream."""
        for request_id, stream in list(self._streams.items()):
            stream.put(error)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
                self._unhealthy_reason = "aborting a failed request raised"
        self._streams.clear()
        self._update_no_requests()
        # Leased blocks are a transfer's, not a request's: they go back when the lease ends.
        if self.engine.memory_stats().num_used_blocks != self.engine.kv_connector.num_held_blocks:
            self._unhealthy_reason = "KV blocks stayed in use after every request was aborted"

    def _stop(self) -> None:
        self._fail_all(EngineClosedError("the request was aborted: the server is shutting down"))
        self._is_stopping = True

    def _resize_when_idle(self) -> None:
        """Steps resize the KV pool themselves; with no step to run, an elastic pool still
        gets to give idle memory back (for a static pool this does nothing)."""
        try:
            self.engine.resize_kv_pool()
        except Exception:
            logger.exception("resizing the idle KV pool failed")
            self._unhealthy_reason = "resizing the idle KV pool raised"

    def _update_no_requests(self) -> None:
        if not self._streams:
            self._no_requests.set()

    def _take_snapshot(self) -> EngineSnapshot:
        num_running, num_waiting = self.engine.request_counts()
        return EngineSnapshot(
            memory=self.engine.memory_stats(),
            kv_pool=self.engine.kv_pool_stats(),
            stats=self.engine.stats(),
            kv_tiers=self.engine.kv_tier_stats(),
            num_requests_running=num_running,
            num_requests_waiting=num_waiting,
            num_failed_steps=self._num_failed_steps,
            kv_transfer=self.engine.kv_connector.stats(),
        )


def _resolve(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    error: BaseException | None,
    result: Any = None,
) -> None:
    """Settle a caller's future on its own loop (from the engine thread)."""

    def settle() -> None:
        if future.done():  # the caller was cancelled (an add has already queued an abort)
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
        loop.call_soon_threadsafe(settle)
