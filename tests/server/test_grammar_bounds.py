"""`BoundedGrammarCompiler`: a grammar too large is refused before compiling, a compile past
its timeout is stopped and is a 400, one tenant has at most one compile in flight, compiles
run on at most `max_compile_threads`, and a grammar already compiled needs neither.
(`tests/engine/test_grammar_process.py` shows the real compile stopped at its timeout.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.structured_outputs import StructuredOutputsParams
from kvpool.openai.errors import OpenAIError
from kvpool.server.grammar_bounds import BoundedGrammarCompiler, GrammarBounds

REGEX = StructuredOutputsParams(regex="[a-z]+")


class GatedCompiler:
    """A stand-in for the engine's compiler: each compile waits for `release` (or not, for a
    spec in `ready`) and is stopped at its timeout (TimeoutError) unless `stubborn`,
    recording the specs compiled and how many ran at once; specs in `cached` are looked up."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.ready: set[str] = set()
        self.cached: set[str] = set()
        self.stubborn = False
        self.num_running = self.max_running = 0
        self._lock = threading.Lock()

    def lookup(self, spec: StructuredOutputsParams) -> object | None:
        return spec if spec.key[1] in self.cached else None

    def compile(self, spec: StructuredOutputsParams, timeout: float | None = None) -> None:
        with self._lock:
            self.started.append(spec.key[1])
            self.num_running += 1
            self.max_running = max(self.max_running, self.num_running)
        try:
            if spec.key[1] not in self.ready:
                is_released = self.release.wait(None if self.stubborn else timeout)
                if not is_released:
                    raise TimeoutError(f"stopped at {timeout} s")
        finally:
            with self._lock:
                self.num_running -= 1

    def close(self) -> None:
        return None


def in_background(compiler: BoundedGrammarCompiler, gated: GatedCompiler, regex: str,
                  tenant: str) -> threading.Thread:
    """Start a compile that runs until `gated.release` (a stubborn one) and wait until it
    has begun."""
    gated.stubborn = True
    thread = threading.Thread(target=compiler.compile,
                              args=(StructuredOutputsParams(regex=regex), tenant))
    thread.start()
    deadline = time.monotonic() + 30
    while regex not in gated.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread


@pytest.fixture
def gated() -> Iterator[GatedCompiler]:
    compiler = GatedCompiler()
    yield compiler
    compiler.release.set()


def bounded(compiler: GatedCompiler, **bounds: float) -> BoundedGrammarCompiler:
    return BoundedGrammarCompiler(compiler, GrammarBounds(**{"compile_timeout": 0.05,
                                                             **bounds}))


def compile_once_free(compiler: BoundedGrammarCompiler, spec: StructuredOutputsParams,
                      tenant: str) -> None:
    """Compile, retrying the 429/503 that last until a released compile's thread has given
    its slot and thread back (it does so just after its compile returns)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return compiler.compile(spec, tenant)
        except OpenAIError:
            if time.monotonic() > deadline:
                raise


def test_a_grammar_over_max_chars_is_refused_without_compiling(gated: GatedCompiler) -> None:
    compiler = bounded(gated, max_chars=16)
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(StructuredOutputsParams(regex="a" * 17), "t")
    assert str(refused.value) == "the regex has 17 characters; at most 16 are accepted"
    assert refused.value.param == "structured_outputs.regex"
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    with pytest.raises(InvalidRequestError, match="the JSON schema has 57 characters"):
        compiler.compile(StructuredOutputsParams(json=schema), "t")
    assert gated.started == []
    gated.ready.add("a" * 16)
    compiler.compile(StructuredOutputsParams(regex="a" * 16), "t")  # at the bound: compiled
    assert gated.started == ["a" * 16]


def test_a_slow_compile_is_stopped_at_the_timeout_and_frees_the_tenants_slot(
    gated: GatedCompiler,
) -> None:
    compiler = bounded(gated)
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(REGEX, "noisy")
    assert refused.value.param == "structured_outputs.regex"
    assert str(refused.value).startswith("the regex did not compile within 0.05 s")
    assert gated.num_running == 0  # stopped, not left running
    gated.ready.add("[0-9]+")
    compiler.compile(StructuredOutputsParams(regex="[0-9]+"), "noisy")
    assert gated.started == ["[a-z]+", "[0-9]+"]


def test_a_tenant_has_one_compile_in_flight(gated: GatedCompiler) -> None:
    compiler = bounded(gated)
    running = in_background(compiler, gated, "[a-z]+", "noisy")
    gated.ready.add("[0-9]+")
    with pytest.raises(OpenAIError) as busy:
        compiler.compile(StructuredOutputsParams(regex="[0-9]+"), "noisy")
    assert busy.value.status_code == 429
    compiler.compile(StructuredOutputsParams(regex="[0-9]+"), "quiet")
    assert gated.started == ["[a-z]+", "[0-9]+"]
    gated.release.set()
    running.join()
    compile_once_free(compiler, StructuredOutputsParams(regex="[0-9]+"), "noisy")
    assert gated.started == ["[a-z]+", "[0-9]+", "[0-9]+"]


def test_compiles_use_at_most_max_compile_threads(gated: GatedCompiler) -> None:
    compiler = bounded(gated, max_compile_threads=2)
    running = [in_background(compiler, gated, tenant, tenant) for tenant in ("a", "b")]
    gated.ready.add("c")
    with pytest.raises(OpenAIError) as busy:  # a third tenant finds no thread free
        compiler.compile(StructuredOutputsParams(regex="c"), "c")
    assert busy.value.status_code == 503
    assert gated.started == ["a", "b"] and gated.max_running == 2
    gated.cached.add("d")  # compiled before: needs no thread
    compiler.compile(StructuredOutputsParams(regex="d"), "c")
    gated.release.set()
    for thread in running:
        thread.join()
    compile_once_free(compiler, StructuredOutputsParams(regex="c"), "c")
    assert gated.started == ["a", "b", "c"]


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="grammar_compile_timeout must be > 0"):
        GrammarBounds(compile_timeout=0)
    with pytest.raises(ValueError, match="at least 1"):
        GrammarBounds(max_chars=0)
