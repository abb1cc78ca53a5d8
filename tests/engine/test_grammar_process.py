"""Compiles with a timeout run in a child process that is killed at the deadline
(`kvpool.engine.grammar_process`): the CPU a too-complex grammar costs ends with its 400, the
grammar a child compiles is the one the parent would, refusals keep xgrammar's verdict, and
`lookup` answers from the cache alone; children run at a lower priority than the engine."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling.grammar import GrammarCompiler
from kvpool.engine.structured_outputs import StructuredOutputsParams

SCHEMA = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                       "required": ["n"]})
SLOW = StructuredOutputsParams(regex=".{0,100000}")  # unrolls into a huge grammar: seconds

pytestmark = pytest.mark.processes  # compiles with a timeout start child processes


@pytest.fixture
def compiler(smollm2):
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size)
    yield compiler
    compiler.close()


def grammar_children() -> list[multiprocessing.Process]:
    return [child for child in multiprocessing.active_children()
            if child.name == "kvpool-grammar"]


def test_a_child_compiles_the_grammar_the_parent_would(smollm2, compiler) -> None:
    in_child = compiler.compile(SCHEMA, timeout=60)
    in_process = GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size).compile(SCHEMA)
    assert in_child.grammar.serialize_json() == in_process.grammar.serialize_json()
    matcher = in_child.new_matcher()
    for token_id in smollm2.tokenizer.encode('{"n": 7}'):
        assert matcher.accept(token_id)


def test_a_compile_past_its_timeout_is_killed_and_not_cached(compiler) -> None:
    compiler.compile(SCHEMA, timeout=60)  # a child is started and kept idle
    [idle] = grammar_children()
    assert os.getpriority(os.PRIO_PROCESS, idle.pid) > os.getpriority(os.PRIO_PROCESS, 0)
    with pytest.raises(TimeoutError):
        compiler.compile(SLOW, timeout=0.2)
    assert not idle.is_alive() and idle.exitcode < 0  # killed: its compile stopped there
    assert grammar_children() == []
    assert compiler.lookup(SLOW) is None  # a stopped compile caches nothing
    again = compiler.compile(StructuredOutputsParams(regex="[a-z]+"), timeout=60)
    assert again is compiler.lookup(StructuredOutputsParams(regex="[a-z]+"))  # a fresh child


def test_a_refused_spec_is_a_400_from_the_child_too(compiler) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(StructuredOutputsParams(regex="(unclosed"), timeout=60)
    assert refused.value.param == "structured_outputs.regex"


def test_lookup_never_compiles(compiler) -> None:
    assert compiler.lookup(SCHEMA) is None
    assert compiler.num_cached == 0
    compiled = compiler.compile(SCHEMA)
    assert compiler.lookup(SCHEMA) is compiled
