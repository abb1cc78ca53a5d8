"""Bounds on the grammar work a request can ask of the server: the size of its grammar,
schema or regex, how long its compile may take, how many compiles run at once, and one
compile in flight per tenant.

    tenant's input work ─▶ size check ─▶ tenant's slot ─▶ compile pool (max_compile_threads)
                            400            429 after           400 past compile_timeout
                                           compile_timeout     (503 if it never started)

A compile runs in a child process killed at `compile_timeout` (`GrammarCompiler.compile`
with a timeout; xgrammar cannot stop a compile, so a thread would keep its core busy for
minutes after the 400): the CPU one request costs is bounded, not only its wait. A grammar
already compiled (`GrammarCompiler.lookup`) takes neither a slot nor a thread. One tenant
holds at most one compile thread however many requests it sends; the others find a thread
free while fewer tenants than `max_compile_threads` are busy.

Invariant: a tenant's slot is held exactly while a compile it asked for is queued or running.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.structured_outputs import StructuredOutputsParams
from kvpool.openai.errors import OpenAIError
from kvpool.server.input_executor import FairExecutor

DEFAULT_MAX_GRAMMAR_CHARS = 131_072  # a JSON schema of a few hundred fields fits easily
DEFAULT_COMPILE_TIMEOUT = 1.0  # seconds; a typical schema compiles in milliseconds
DEFAULT_MAX_COMPILE_THREADS = 2


@dataclass(frozen=True, slots=True)
class GrammarBounds:
    """How much grammar work one request may cause (`--max-grammar-chars`,
    `--grammar-compile-timeout`)."""

    max_chars: int = DEFAULT_MAX_GRAMMAR_CHARS  # of the schema/regex/grammar/choices text
    compile_timeout: float = DEFAULT_COMPILE_TIMEOUT
    max_compile_threads: int = DEFAULT_MAX_COMPILE_THREADS

    def __post_init__(self) -> None:
        if self.max_chars < 1 or self.max_compile_threads < 1:
            raise ValueError("max_grammar_chars and max_compile_threads must be at least 1")
        if not self.compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.compile_timeout}")

    def check_size(self, spec: StructuredOutputsParams) -> None:
        """InvalidRequestError for a spec whose text (canonical form) is longer than
        `max_chars`."""
        kind, text = spec.key
        if len(text) > self.max_chars:
            raise InvalidRequestError(
                f"the {_NAMES[kind]} has {len(text)} characters; at most {self.max_chars} are "
                f"accepted", f"structured_outputs.{kind}")


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list",
          "grammar": "grammar", "json_object": "JSON object grammar"}


class BoundedGrammarCompiler:
    """Compiles specs with an engine's `GrammarCompiler` under `GrammarBounds`; thread-safe.
    `for_tenant(tenant)` is what one request's input work compiles through."""

    def __init__(self, compiler: Any, bounds: GrammarBounds) -> None:
        """`compiler`: the engine's `GrammarCompiler` (its `compile(spec)` caches)."""
        self.compiler = compiler
        self.bounds = bounds
        # Daemon threads, tenants in turn: a compile nobody waits for any more must not hold
        # the process at exit, nor one tenant's queued compiles another's.
        self._pool = FairExecutor(bounds.max_compile_threads, name="kvpool-grammar")
        self._slots: dict[str, threading.Lock] = {}
        self._slots_lock = threading.Lock()

    def for_tenant(self, tenant: str) -> TenantGrammarCompiler:
        return TenantGrammarCompiler(self, tenant)

    def compile(self, spec: StructuredOutputsParams, tenant: str) -> None:
        """Compile `spec` for `tenant` within the bounds: InvalidRequestError (400) for a spec
        too large, refused by xgrammar or past the timeout; OpenAIError 429 while the tenant's
        previous compile still runs, 503 if no compile thread came free in time."""
        self.bounds.check_size(spec)
        if self.compiler.lookup(spec) is not None:
            return
        timeout = self.bounds.compile_timeout
        slot = self._slot(tenant)
        if not slot.acquire(timeout=timeout):
            raise OpenAIError(429, "a grammar of this tenant is still compiling; retry later",
                              f"structured_outputs.{spec.kind}", headers={"Retry-After": "1"})
        started = threading.Event()
        future = self._pool.submit(tenant, self._compile_holding, slot, started, spec)
        if not started.wait(timeout) and future.cancel():
            slot.release()
            raise OpenAIError(503, "every grammar compile thread is busy; retry later",
                              headers={"Retry-After": "1"})
        self._wait(future, spec)

    def shutdown(self) -> None:
        """Start no more compiles (those running end at their timeout) and stop the idle
        compiler processes."""
        self._pool.shutdown(wait=False)
        self.compiler.close()

    def _wait(self, future: Future, spec: StructuredOutputsParams) -> None:
        try:
            future.result()
        except TimeoutError as error:  # the compile was stopped at the timeout
            raise InvalidRequestError(
                f"the {_NAMES[spec.kind]} did not compile within "
                f"{self.bounds.compile_timeout:g} s: it is too complex (bounded repetitions "
                f"such as {{0,100000}} unroll into large grammars)",
                f"structured_outputs.{spec.kind}") from error

    def _compile_holding(self, slot: threading.Lock, started: threading.Event,
                         spec: StructuredOutputsParams) -> None:
        started.set()
        try:
            self.compiler.compile(spec, timeout=self.bounds.compile_timeout)
        finally:
            slot.release()

    def _slot(self, tenant: str) -> threading.Lock:
        with self._slots_lock:
            slot = self._slots.get(tenant)
            if slot is None:
                slot = self._slots[tenant] = threading.Lock()
            return slot


@dataclass(frozen=True, slots=True)
class TenantGrammarCompiler:
    """One tenant's view: `compile(spec)`, as `kvpool.openai.structured.compile_constraint`
    calls it."""

    bounded: BoundedGrammarCompiler
    tenant: str

    def compile(self, spec: StructuredOutputsParams) -> None:
        self.bounded.compile(spec, self.tenant)
