"""Structured outputs' grammars: compiling a `StructuredOutputsParams` with xgrammar, and the
per-sequence matcher that says which tokens may come next.

`GrammarCompiler.compile(spec)` turns a spec into a `CompiledGrammar` (token-level: it knows
the model's vocabulary) and keeps the latest `cache_size` of them, keyed by `spec.key`, so
equal specs compile once. It is thread-safe, and a spec that several
threads ask for at once is compiled once: the others wait for the first. Compiling can take
milliseconds to seconds, so callers do it before a request reaches the engine's step loop:
the async engine compiles in a worker thread, the server while validating input;
`LLMEngine.add_request` then only hits the cache (offline, `add_request` is itself "ahead" of
the steps). `compile(spec, timeout=t)` compiles in a child process killed at the deadline
(`kvpool.engine.grammar_process`: xgrammar cannot stop a compile, so a thread would keep its
core busy); the server compiles that way. `lookup(spec)` is the cache alone.

`GrammarMatcher` is one sequence's position in its grammar: `fill` writes the allowed next
tokens into a row of an int32 bitmask (bit `t % 32` of word `t // 32` set: token t allowed),
`accept` advances by the sampled token; the sampler does both (`kvpool.engine.sampling`). A
matcher moves forward with the sequence's output tokens, which preemption (recompute or swap)
keeps, so its state stays valid across preemptions; it moves back (`rewind_to`, xgrammar's
rollback) to undo a step that was rolled back after sampling, and after walking through
speculative drafts (cutting them at proposal, masking their verification rows). Token ids the
model has beyond the tokenizer's are never allowed.

`GrammarCompiler.new_matcher(spec)` is where a request's matchers come from: a
`GrammarMatcher`, or for a spec with `thinking` an `AfterThinking` around two of them, whose
grammar starts after the output's thinking (`kvpool.engine.sampling.after_thinking`). Both are
`Matcher`s: the engine holds and reads them alike.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.grammar_process import (
    GrammarProcesses,
    choice_grammar,
    compile_spec,
    new_compiler,
    xgrammar_module,
)
from kvpool.engine.sampling.after_thinking import AfterThinking, ThinkingMarks
from kvpool.engine.sampling.matcher import Matcher
from kvpool.engine.structured_outputs import StructuredOutputsParams, Thinking

if TYPE_CHECKING:
    import torch
    import xgrammar

    from kvpool.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept; a JSON schema's is tens to hundreds of KiB
MAX_THINKING_MARKS = 16  # `Thinking` markers kept per compiler (a server has one)
BITS_PER_WORD = 32  # the bitmask is int32 (xgrammar's `bitmask_dtype`)

# What each kind's compile failure says. Fixed text: xgrammar's own messages quote the spec,
# and a server must not echo client input back.
_INVALID = {
    "json": "the JSON schema is invalid or uses features that are not supported",
    "regex": "the regex is invalid or uses features that are not supported",
    "choice": "the choices cannot be compiled",
    "grammar": "the grammar is not valid EBNF (or uses features that are not supported)",
    "json_object": "the JSON grammar cannot be compiled",
}


class GrammarMatcher:
    """One sequence's state in its grammar (an xgrammar matcher), advanced token by token by
    the sampler (`kvpool.engine.sampling.constraints.advance_grammars`) and read by the stop
    rules (`has_rejected`, `has_ended`).

    Invariant: `num_accepted` counts the tokens the xgrammar matcher has accepted; it equals
    the sequence's output tokens between steps, or is one less once the grammar rejected a
    token (the sequence then stops), and runs ahead only after a step that was rolled back,
    until `rewind_to` brings it back. Within a step it also runs ahead while a verification's
    kept tokens join the sequence one by one: the stop rules therefore ask about the
    sequence's first n outputs, not about the matcher's latest token."""

    __slots__ = ("_matcher", "is_rejected", "num_accepted")

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher
        self.num_accepted = 0
        self.is_rejected = False  # the latest token was one the grammar does not allow

    def rewind_to(self, num_tokens: int) -> None:
        """Forget the tokens accepted beyond the first `num_tokens` (those of a step rolled
        back after the sampler ran: its sequences never got them)."""
        excess = self.num_accepted - num_tokens
        if excess > 0:
            self._matcher.rollback(excess)
            self.num_accepted = num_tokens
        self.is_rejected = False

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the tokens allowed next into `bitmask[row]` (a CPU int32 tensor of
        `bitmask_width` words per row); return whether the row forbids anything. A terminated
        matcher leaves its row as it was (its sequence has ended) and returns False."""
        if self._matcher.is_terminated():
            return False
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged, `is_rejected` set) if the grammar
        does not allow it."""
        is_accepted = self._matcher.accept_token(token_id)
        if is_accepted:
            self.num_accepted += 1
        self.is_rejected = not is_accepted
        return is_accepted

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) has been accepted."""
        return self._matcher.is_terminated()

    def has_rejected(self, num_outputs: int) -> bool:
        """The sequence's `num_outputs`-th output token is one the grammar rejected (the
        tokens before it were accepted, so the rejection is that token's)."""
        return self.is_rejected and self.num_accepted == num_outputs - 1

    def has_ended(self, num_outputs: int) -> bool:
        """The grammar ended within the sequence's first `num_outputs` output tokens (nothing
        is accepted after its end, so `num_accepted` is where it ended)."""
        return self._matcher.is_terminated() and self.num_accepted <= num_outputs


@dataclass(frozen=True, eq=False, slots=True)
class CompiledGrammar:
    """A spec compiled against one vocabulary; makes any number of matchers."""

    key: tuple[str, str]  # `spec.key`
    grammar: xgrammar.CompiledGrammar

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of the grammar (cheap: microseconds)."""
        return GrammarMatcher(xgrammar_module().GrammarMatcher(self.grammar))


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary, caching the latest."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int] | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """`vocab_size` is the model's (its logits' width), which may exceed the tokenizer's;
        `stop_token_ids` (default: the tokenizer's EOS ids) end a completed grammar."""
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(
            tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()  # guards the cache
        self._init_lock = threading.Lock()  # guards building xgrammar's compiler
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._info: xgrammar.TokenizerInfo | None = None  # built on first use (~0.3 s)
        self._compiler: xgrammar.GrammarCompiler | None = None  # in-process compiles
        self._processes: GrammarProcesses | None = None  # compiles with a timeout
        self._marks: OrderedDict[Thinking, ThinkingMarks] = OrderedDict()  # under `_init_lock`
        self._vocab_bytes: tuple[bytes, ...] | None = None  # token id -> bytes, on first use

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return -(-self.vocab_size // BITS_PER_WORD)

    @property
    def num_cached(self) -> int:
        """Compiled grammars in the cache (and compiles under way)."""
        with self._lock:
            return len(self._cache)

    def lookup(self, spec: StructuredOutputsParams) -> CompiledGrammar | None:
        """The spec's compiled grammar if the cache holds it compiled, else None (never
        compiles, never waits)."""
        with self._lock:
            future = self._cache.get(spec.key)
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def compile(self, spec: StructuredOutputsParams,
                timeout: float | None = None) -> CompiledGrammar:
        """The spec's compiled grammar, from the cache or compiled now; InvalidRequestError
        (param `structured_outputs.<kind>`) if xgrammar rejects it. With `timeout`, a compile
        runs in a child process and raises TimeoutError past `timeout` seconds (the compile
        stopped, nothing cached)."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            is_owner = future is None
            if is_owner:
                future = Future()
                self._cache[key] = future
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if is_owner:
            self._compile_into(future, key, timeout)
        compiled = future.result()
        if spec.thinking is not None:  # ready before the engine thread makes its matchers
            self.thinking_marks(spec.thinking)
        return compiled

    def new_matcher(self, spec: StructuredOutputsParams) -> Matcher:
        """A matcher at the start of `spec`'s output (its grammar compiled now unless cached):
        the grammar from the first token, or after the thinking if `spec.thinking`."""
        compiled = self.compile(spec)
        if spec.thinking is None:
            return compiled.new_matcher()
        return AfterThinking(self.thinking_marks(spec.thinking), compiled.new_matcher(),
                             compiled.new_matcher())

    def thinking_marks(self, thinking: Thinking) -> ThinkingMarks:
        """`thinking`'s markers in this vocabulary (built once: the first builds every
        token's bytes, ~0.1 s per 50,000 tokens)."""
        with self._init_lock:
            marks = self._marks.get(thinking)
            if marks is None:
                marks = self._marks[thinking] = ThinkingMarks.build(
                    thinking, self.tokenizer, self._token_bytes())
                while len(self._marks) > MAX_THINKING_MARKS:
                    self._marks.popitem(last=False)
            return marks

    def close(self) -> None:
        """Stop the idle compiler processes (a later compile with a timeout starts more)."""
        with self._init_lock:
            if self._processes is not None:
                self._processes.close()

    def _compile_into(self, future: Future[CompiledGrammar], key: tuple[str, str],
                      timeout: float | None) -> None:
        """Compile for every thread waiting on `future`; a failure is not cached."""
        kind = key[0]
        try:
            grammar = self._compile(key, timeout)
        except BaseException as error:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]
            if isinstance(error, (RuntimeError, ValueError, TypeError)):  # xgrammar's refusals
                logger.debug("xgrammar rejected a %s spec: %s", kind, error)
                error = InvalidRequestError(_INVALID[kind], f"structured_outputs.{kind}")
            future.set_exception(error)
            return
        future.set_result(CompiledGrammar(key, grammar))

    def _compile(self, key: tuple[str, str], timeout: float | None) -> xgrammar.CompiledGrammar:
        if timeout is None:
            return compile_spec(self._xgrammar_compiler(), *key)
        return self._compiler_processes().compile(*key, timeout)

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._init_lock:
            if self._compiler is None:
                self._compiler = new_compiler(self._tokenizer_info())
            return self._compiler

    def _compiler_processes(self) -> GrammarProcesses:
        with self._init_lock:
            if self._processes is None:
                self._processes = GrammarProcesses(self._tokenizer_info())
            return self._processes

    def _token_bytes(self) -> tuple[bytes, ...]:
        """Every token's bytes, as the grammar reads them; the caller holds `_init_lock`."""
        if self._vocab_bytes is None:
            self._vocab_bytes = tuple(map(bytes, self._tokenizer_info().decoded_vocab))
        return self._vocab_bytes

    def _tokenizer_info(self) -> xgrammar.TokenizerInfo:
        """Built once (~0.3 s); the caller holds `_init_lock`."""
        if self._info is None:
            self._info = xgrammar_module().TokenizerInfo.from_huggingface(
                self.tokenizer.hf_tokenizer, vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids)
        return self._info


__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "choice_grammar"]
