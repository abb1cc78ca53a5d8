"""A grammar that holds only a reasoning model's answer, after its thinking (a spec's
`Thinking`; vLLM's structured outputs likewise wait for the reasoning parser's end).

    start None (deepseek_r1)      [thinking ......... </think>][answer: the grammar ......]
    start "<think>" (qwen3)       [<think> thinking .. </think>][answer: the grammar .....]
                                  or, not opening with "<think>": [answer: the grammar ...]

`AfterThinking` wraps the grammar's matchers behind the same interface as a plain
`GrammarMatcher` (the sampler's `TokenMask`, the stop rules' `has_rejected` / `has_ended`), so
the sampler masks its rows, the stop rules read it and the speculator walks drafts through it
without knowing. Its phase is a function of the output's text so far:

    OPENING   (a `start` marker only) the text is a proper prefix of it: allowed are the
              grammar's tokens (the answer may begin here) and the next token of the marker's
              canonical tokenization, so the output may still open with it whatever the grammar
    THINKING  unconstrained (fills no mask, accepts every token) until the text holds `end`
    ANSWER    the grammar's, from the token after the one that completed `end` (or, when the
              output did not open with `start`, from its first token)

Markers are found in the text (each token's bytes, xgrammar's decoded vocabulary), not as
token ids: any tokenization of `</think>` ends the thinking, as for the reasoning parser that
splits the text (`kvpool.openai.reasoning`). Bytes a token carries past the end marker (a
`><` token) belong to the answer's text but are not read by its grammar.

Invariant: the state is a function of the first `num_accepted` output tokens. `_steps[i]` is
the phase (and marker text) after output token i, kept for every token up to the one that
starts the answer, so `len(_steps)` is where the answer begins once it has; the answer's
grammar has accepted exactly the tokens from `_answer_start` on (`_from_start` from 0, `_after`
from the token after `end`). `rewind_to(n)` cuts `_steps` to n and rewinds the grammars to what
the first n tokens gave them, across the boundary in either direction (a step rolled back, drafts
walked past `</think>`). `accept` takes exactly the tokens `fill` allows, so drafts are cut
where the mask would have refused them.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvpool.engine.sampling.constraints import allow_token
from kvpool.engine.sampling.matcher import TokenMask

if TYPE_CHECKING:
    import torch

    from kvpool.engine.structured_outputs import Thinking
    from kvpool.model.tokenizer import Tokenizer

OPENING, THINKING, ANSWER = "opening", "thinking", "answer"


class _Step(NamedTuple):
    phase: str  # after the token
    text: bytes  # OPENING: the output's text; THINKING: its end that may begin the end marker


_THINKING = _Step(THINKING, b"")  # most thinking tokens' step, shared
_ANSWER = _Step(ANSWER, b"")


@dataclass(frozen=True, slots=True)
class ThinkingMarks:
    """A `Thinking` in one vocabulary's terms, built once per compiler and markers."""

    start: bytes  # b"": the output begins inside the thinking
    end: bytes
    # `start`'s canonical tokenization as steps: the text of its first k tokens -> token k.
    # Empty if those tokens do not spell `start` exactly (a tokenizer adding a space).
    next_start_token: Mapping[bytes, int]
    token_bytes: SequenceOf[bytes]  # token id -> its text's bytes

    @classmethod
    def build(cls, thinking: Thinking, tokenizer: Tokenizer,
              token_bytes: SequenceOf[bytes]) -> ThinkingMarks:
        start = (thinking.start or "").encode()
        token_ids = tokenizer.encode(thinking.start, False) if thinking.start else []
        steps: dict[bytes, int] = {}
        text = b""
        for token_id in token_ids:
            if token_id >= len(token_bytes):
                return cls(start, thinking.end.encode(), {}, token_bytes)
            steps[text] = token_id
            text += token_bytes[token_id]
        return cls(start, thinking.end.encode(), steps if text == start else {}, token_bytes)

    @property
    def first_phase(self) -> str:
        return OPENING if self.start else THINKING

    def text(self, token_id: int) -> bytes:
        """The token's bytes (none for an id beyond the tokenizer's)."""
        return self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""


class AfterThinking:
    """A grammar that starts after the output's thinking (module docstring)."""

    __slots__ = ("_after", "_answer", "_answer_start", "_from_start", "_marks", "_steps",
                 "is_rejected", "num_accepted")

    def __init__(self, marks: ThinkingMarks, from_start: TokenMask, after: TokenMask) -> None:
        """`from_start` and `after`: two fresh matchers of the grammar, for an answer that
        begins at the first token and for one that begins after the thinking."""
        self._marks = marks
        self._from_start = from_start
        self._after = after
        self._steps: list[_Step] = []
        self._answer: TokenMask | None = None  # `_from_start` or `_after` once answering
        self._answer_start = 0  # output tokens before the answer grammar's first token
        self.num_accepted = 0
        self.is_rejected = False  # the latest token was one the grammar does not allow

    @property
    def phase(self) -> str:
        """OPENING, THINKING or ANSWER: where the next token goes."""
        return self._steps[-1].phase if self._steps else self._marks.first_phase

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """As `GrammarMatcher.fill`; a thinking row is left as it was (all allowed)."""
        phase = self.phase
        if phase == ANSWER:
            return self._answer.fill(bitmask, row)
        if phase == THINKING:
            return False
        next_start = self._marks.next_start_token.get(self._text)
        if self._is_grammar_open:
            needs_apply = self._from_start.fill(bitmask, row)
        else:  # only the marker's tokens brought the output here
            assert next_start is not None, "without the grammar, only the marker leads here"
            bitmask[row] = 0
            needs_apply = True
        if needs_apply and next_start is not None:
            allow_token(bitmask, row, next_start)
        return needs_apply

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged, `is_rejected` set) if it is not
        allowed."""
        phase = self.phase
        if phase == ANSWER:
            is_accepted = self._answer.accept(token_id)
        elif phase == THINKING:
            self._think(self._text + self._marks.text(token_id))
            is_accepted = True
        else:
            is_accepted = self._open(token_id)
        self.num_accepted += is_accepted
        self.is_rejected = not is_accepted
        return is_accepted

    def rewind_to(self, num_tokens: int) -> None:
        """Forget the tokens accepted beyond the first `num_tokens`, whatever phase they
        were in."""
        self.is_rejected = False
        if num_tokens >= self.num_accepted:
            return
        self.num_accepted = num_tokens
        if self._answer is not None and num_tokens >= len(self._steps):
            self._answer.rewind_to(num_tokens - self._answer_start)
            return
        del self._steps[num_tokens:]
        self._answer = None
        self._after.rewind_to(0)
        self._from_start.rewind_to(num_tokens)  # its state if the text is still OPENING

    @property
    def is_terminated(self) -> bool:
        """The answer's grammar is complete and its stop token accepted."""
        return self._answer is not None and self._answer.is_terminated

    def has_rejected(self, num_outputs: int) -> bool:
        """As `GrammarMatcher.has_rejected`."""
        return self.is_rejected and self.num_accepted == num_outputs - 1

    def has_ended(self, num_outputs: int) -> bool:
        """As `GrammarMatcher.has_ended`."""
        return self.is_terminated and self.num_accepted <= num_outputs

    @property
    def _text(self) -> bytes:
        return self._steps[-1].text if self._steps else b""

    @property
    def _is_grammar_open(self) -> bool:
        """While OPENING: the grammar took every token so far (the answer may begin at the
        first token)."""
        return self._from_start.num_accepted == self.num_accepted

    def _open(self, token_id: int) -> bool:
        """Accept an OPENING token: the grammar's, or the start marker's next one."""
        marks = self._marks
        is_marker = marks.next_start_token.get(self._text) == token_id
        is_grammar = self._is_grammar_open and self._from_start.accept(token_id)
        if not (is_grammar or is_marker):
            return False
        text = self._text + marks.text(token_id)
        if text.startswith(marks.start):
            self._think(text[len(marks.start):])
        elif marks.start.startswith(text):
            self._steps.append(_Step(OPENING, text))
        else:  # not the marker: the grammar took this token and all before it
            assert is_grammar, "the start marker's canonical tokens spell it"
            self._begin_answer(self._from_start, 0)
        return True

    def _think(self, text: bytes) -> None:
        """Record a thinking token, `text` being the marker text it leaves (what was kept of
        the text before it, and its bytes)."""
        end = self._marks.end
        if end in text:
            self._begin_answer(self._after, len(self._steps) + 1)
            return
        tail = _partial_end(text, end)
        self._steps.append(_Step(THINKING, tail) if tail else _THINKING)

    def _begin_answer(self, grammar: TokenMask, answer_start: int) -> None:
        self._steps.append(_ANSWER)
        self._answer = grammar
        self._answer_start = answer_start


def _partial_end(text: bytes, marker: bytes) -> bytes:
    """The longest end of `text` that begins `marker` (and may still complete it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return text[-length:]
    return b""
