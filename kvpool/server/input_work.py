"""`InputWork`: where the routes run the work a request's input costs before it reaches the
engine (tokenizing, rendering chat templates, compiling grammars), so that it neither blocks
the event loop nor lets one tenant's inputs delay another's.

    route ─ await input_work.run(tenant, fn, ...) ─▶ FairExecutor (input_workers threads,
                                                      tenants in turn) ─▶ fn(...)
    fn's grammar compiles ─ input_work.grammars(tenant) ─▶ BoundedGrammarCompiler

It replaces `asyncio.to_thread`, whose shared pool served every tenant first come, first
served (a tenant's burst of megabyte prompts queued everyone behind it). Waiting is cancelled
with the request: work still queued when its client goes is never run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from kvpool.engine.structured_outputs import StructuredOutputsParams
from kvpool.server.config import ServerConfig
from kvpool.server.grammar_bounds import BoundedGrammarCompiler, GrammarBounds
from kvpool.server.input_executor import FairExecutor

T = TypeVar("T")


class NoGrammarCompiler:
    """For an engine without a grammar compiler (no tokenizer): nothing to compile here; the
    engine refuses a constrained request itself."""

    def for_tenant(self, tenant: str) -> NoGrammarCompiler:
        return self

    def compile(self, spec: StructuredOutputsParams) -> None:
        return None

    def shutdown(self) -> None:
        return None


class InputWork:
    """The input executor and the grammar bounds of one server."""

    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.executor = FairExecutor(config.input_workers)
        compiler = engine.grammar_compiler
        bounds = GrammarBounds(config.max_grammar_chars, config.grammar_compile_timeout)
        self._grammars: BoundedGrammarCompiler | NoGrammarCompiler = (
            NoGrammarCompiler() if compiler is None else BoundedGrammarCompiler(compiler, bounds))

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the executor, in `tenant`'s turn; cancelling the await cancels it if
        it has not started."""
        return await asyncio.wrap_future(self.executor.submit(tenant, fn, *args))

    def grammars(self, tenant: str) -> Any:
        """What `tenant`'s input work compiles constraints with (`compile(spec)`)."""
        return self._grammars.for_tenant(tenant)

    def close(self) -> None:
        """Run nothing more (at the server's shutdown)."""
        self.executor.shutdown(wait=False)
        self._grammars.shutdown()
