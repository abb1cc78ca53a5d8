"""Compiling grammars where a compile can be stopped: in child processes.

xgrammar cannot interrupt a compile once it has begun, and some valid specs (a JSON schema of
thousands of optional fields, a regex such as `.{0,100000}`) compile for minutes. Run in a
thread, such a compile keeps a core busy long after its request got its 400, so a time limit
on waiting would bound nothing a neighbour feels. `GrammarProcesses.compile` runs the compile
in a child process and kills the child at the deadline: the CPU it costs ends there.

    caller thread ─ send (kind, text) ─▶ child: xgrammar compile ─▶ serialized grammar
                  ◀─ poll(timeout) ─────        (killed at the deadline; the next compile
                                                 starts a fresh child)

The child imports this module and xgrammar (which imports torch: ~2 s of CPU), never the
engine, and runs at a lower priority (`CHILD_NICENESS`): input work yields to decode steps.
`compile_spec` is how each kind of spec becomes an xgrammar compile, used
by the parent's in-process path too, so both compile the same grammar.

Invariant: a child in `_idle` is alive, ready, and waits for its next request; a child being
used by a caller is in no list, and is either returned to `_idle` or killed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvpool.optional import require

if TYPE_CHECKING:
    import xgrammar

START_TIMEOUT = 60.0  # seconds for a child to import xgrammar and say it is ready
INVALID = "invalid"  # a child's answer when xgrammar refused the spec
# Compiles yield the CPU to the engine's decode threads: one request's input work must not
# stretch every running request's steps (on a 2-core machine a compile takes half of it).
CHILD_NICENESS = 10
MAX_NICENESS = 19  # the lowest priority Linux has


def compile_spec(compiler: xgrammar.GrammarCompiler, kind: str,
                 text: str) -> xgrammar.CompiledGrammar:
    """Compile one spec (`StructuredOutputsParams.key`: kind and canonical text)."""
    if kind == "json":
        # any_whitespace: vLLM's default (its `disable_any_whitespace` is off).
        return compiler.compile_json_schema(text, any_whitespace=True)
    if kind == "json_object":
        # An object, as OpenAI's json_object promises (the builtin JSON grammar would let the
        # model answer with an array or a bare number).
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    assert kind == "grammar", kind
    return compiler.compile_grammar(text)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`.

    Each choice becomes a double-quoted EBNF literal in JSON's escaping (quotes, backslashes
    and control characters escaped); non-ASCII text stays as it is, because xgrammar's EBNF
    reads \\u escapes one UTF-16 unit at a time and would split characters beyond the BMP.
    """
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def xgrammar_module() -> ModuleType:
    """xgrammar, imported when a grammar is first compiled (an optional dependency)."""
    return require("xgrammar", "structured outputs (and tool_choice)")


def new_compiler(info: xgrammar.TokenizerInfo) -> xgrammar.GrammarCompiler:
    """One compile uses one thread (xgrammar's default is 8: one request would take every
    core); kvpool's LRU is the cache (xgrammar's own would be a second, unbounded one)."""
    return xgrammar_module().GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _serve(conn: Connection, tokenizer_info_json: str) -> None:
    """The child: compile each (kind, text) received; answer the serialized grammar, or
    (INVALID, message) when xgrammar refuses it. Ends when the parent closes the pipe."""
    info = xgrammar_module().TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = new_compiler(info)
    conn.send("ready")
    while True:
        try:
            kind, text = conn.recv()
        except EOFError:
            return
        try:
            conn.send(compile_spec(compiler, kind, text).serialize_json())
        except (RuntimeError, ValueError, TypeError) as error:
            conn.send((INVALID, str(error)))


@dataclass(slots=True)
class _Child:
    process: Any  # multiprocessing.Process (spawn context)
    conn: Connection

    def kill(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.join()


class GrammarProcesses:
    """Child compilers for one vocabulary; thread-safe. As many children run as callers
    compile at once (the callers' threads bound that); idle ones are kept for the next."""

    def __init__(self, info: xgrammar.TokenizerInfo) -> None:
        self._info = info
        self._info_json = info.serialize_json()
        self._context = multiprocessing.get_context("spawn")  # the server has threads: no fork
        self._idle: list[_Child] = []
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str, timeout: float) -> xgrammar.CompiledGrammar:
        """The spec's compiled grammar. TimeoutError (the child killed) past `timeout`
        seconds of compiling; ValueError with xgrammar's message if it refuses the spec."""
        child = self._take()
        try:
            child.conn.send((kind, text))
            if not child.conn.poll(timeout):
                raise TimeoutError(f"the grammar did not compile within {timeout:g} s")
            answer = child.conn.recv()
        except EOFError as error:  # the child died (xgrammar crashed on this spec)
            child.kill()
            raise RuntimeError("the grammar compiler process ended") from error
        except BaseException:
            child.kill()
            raise
        self._give_back(child)
        if isinstance(answer, tuple):
            raise ValueError(answer[1])
        return xgrammar_module().CompiledGrammar.deserialize_json(answer, self._info)

    def warm(self) -> None:
        """Start one child now (in a thread), so the first compile does not wait for it."""
        threading.Thread(target=lambda: self._give_back(self._take()), daemon=True,
                         name="kvpool-grammar-warm").start()

    def close(self) -> None:
        """Stop the idle children (a compile under way ends its own when it returns)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _take(self) -> _Child:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._start()

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            self._idle.append(child)

    def _start(self) -> _Child:
        parent_conn, child_conn = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child_conn, self._info_json),
                                        daemon=True, name="kvpool-grammar")
        process.start()
        # Niced from its first instant: its start-up (importing xgrammar imports torch, ~2 s
        # of CPU) costs as much as a compile, and follows every compile killed at a deadline.
        niceness = min(os.getpriority(os.PRIO_PROCESS, 0) + CHILD_NICENESS, MAX_NICENESS)
        os.setpriority(os.PRIO_PROCESS, process.pid, niceness)
        child_conn.close()
        child = _Child(process, parent_conn)
        try:
            is_ready = parent_conn.poll(START_TIMEOUT) and parent_conn.recv() == "ready"
        except EOFError:
            is_ready = False
        if not is_ready:
            child.kill()
            raise RuntimeError("a grammar compiler process did not start")
        return child
