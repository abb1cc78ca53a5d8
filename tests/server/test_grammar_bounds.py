"""`BoundedGrammarCompiler`: a grammar too large is refused before compiling, a compile past
its timeout is a 400 at the timeout, one tenant has at most one compile in flight (its slot
held until the compile really ends), and compiles run on at most `max_compile_threads`."""

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
    spec already in `ready`), recording the specs compiled and how many ran at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.ready: set[str] = set()
        self.num_running = self.max_running = 0
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> None:
        with self._lock:
            self.started.append(spec.key[1])
            self.num_running += 1
            self.max_running = max(self.max_running, self.num_running)
        if spec.key[1] not in self.ready:
            self.release.wait()
        with self._lock:
            self.num_running -= 1


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


def test_a_slow_compile_is_a_400_at_the_timeout_and_keeps_the_tenants_slot(
    gated: GatedCompiler,
) -> None:
    compiler = bounded(gated)
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(REGEX, "noisy")
    assert refused.value.param == "structured_outputs.regex"
    assert str(refused.value).startswith("the regex did not compile within 0.05 s")
    # Its compile still runs: the same tenant must wait (429), another tenant goes on.
    gated.ready.add("[0-9]+")
    with pytest.raises(OpenAIError) as busy:
        compiler.compile(StructuredOutputsParams(regex="[0-9]+"), "noisy")
    assert busy.value.status_code == 429
    compiler.compile(StructuredOutputsParams(regex="[0-9]+"), "quiet")
    assert gated.started == ["[a-z]+", "[0-9]+"]
    gated.release.set()  # the slow compile ends: the tenant's slot is free again
    compile_once_free(compiler, StructuredOutputsParams(regex="[0-9]+"), "noisy")
    assert gated.started == ["[a-z]+", "[0-9]+", "[0-9]+"]


def test_compiles_use_at_most_max_compile_threads(gated: GatedCompiler) -> None:
    compiler = bounded(gated, max_compile_threads=2)
    for tenant in ("a", "b"):  # two slow compiles take both threads
        with pytest.raises(InvalidRequestError, match="did not compile"):
            compiler.compile(StructuredOutputsParams(regex=tenant), tenant)
    gated.ready.add("c")
    with pytest.raises(OpenAIError) as busy:  # a third tenant finds no thread free
        compiler.compile(StructuredOutputsParams(regex="c"), "c")
    assert busy.value.status_code == 503
    assert gated.started == ["a", "b"] and gated.max_running == 2
    gated.release.set()
    compile_once_free(compiler, StructuredOutputsParams(regex="c"), "c")
    assert gated.started == ["a", "b", "c"]


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="grammar_compile_timeout must be > 0"):
        GrammarBounds(compile_timeout=0)
    with pytest.raises(ValueError, match="at least 1"):
        GrammarBounds(max_chars=0)
