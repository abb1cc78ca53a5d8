"""A beam request's beams: one round at a time, every live beam's next-token distribution in,
the `width` best continuations out, as forks of the beams they extend.

The beams are sequences of one request. A round starts when every live beam has computed its
last token and offered the sampler's row for it (its `2 * width` most likely tokens under the
model's raw distribution); a beam that finished its step early waits, its KV in place (the
scheduler passes over a running sequence with nothing to compute). `expand` then ranks all
`live × 2·width` candidates by cumulative log probability and keeps the best `width`:
- a kept candidate ending in EOS (unless `ignore_eos`) is a finished beam: a record, no
  sequence, so it holds no block;
- the others continue: a parent's first kept child is the parent itself with the token
  appended, each further one a fork of it (every block shared by reference count; the
  partially filled last block is copied when the fork first writes, by the block table);
- a parent with no kept child is pruned: the scheduler frees its blocks at once.
A beam that reaches `max_tokens` or the model's length is finished with its KV freed.

Ranking (vLLM's): `cum_logprob / len(prompt + generated) ** length_penalty`, a final EOS not
counted. Ties keep the earlier candidate (live beams in fork order, a row's tokens by rank).

Invariants (`check_invariants`): every sequence in `beams` or `rows` is live (unfinished);
`rows` holds only sequences of `beams`, or the request's first before its first round;
at most `width` beams live (finished ones accumulate: each round keeps `width` candidates,
as vLLM's does).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.engine.requests.outputs import Logprob


class BeamSequence(Protocol):
    """What a beam reads of its sequence (`kvpool.engine.sequence.Sequence`); beams are keyed
    by the sequence object itself."""

    output_token_ids: list[int]

    @property
    def is_finished(self) -> bool: ...


@dataclass(frozen=True)
class Beam:
    """A live beam's score so far: the sum of its chosen tokens' log probabilities, and the
    row each was chosen from."""

    cum_logprob: float = 0.0
    logprobs: tuple[dict[int, Logprob], ...] = ()


@dataclass(frozen=True)
class Child:
    """A kept continuation: `token_id` appended to `parent`, scored `beam`."""

    parent: BeamSequence
    token_id: int
    beam: Beam


@dataclass(frozen=True)
class FinishedBeam:
    """A beam that ended: its generated tokens (a final EOS included) and score."""

    token_ids: tuple[int, ...]
    beam: Beam
    finish_reason: str  # "stop" (EOS) or "length"
    ends_in_eos: bool


@dataclass
class BeamGroup:
    width: int
    length_penalty: float
    ignore_eos: bool
    eos_token_ids: frozenset[int]
    prompt_len: int
    max_tokens: int | None
    max_model_len: int
    beams: dict[BeamSequence, Beam] = field(default_factory=dict)  # live sequence -> its score
    rows: dict[BeamSequence, dict[int, Logprob]] = field(default_factory=dict)
    finished: list[FinishedBeam] = field(default_factory=list)

    @property
    def has_expanded(self) -> bool:
        return bool(self.beams or self.finished)

    def offer(self, seq: BeamSequence, logprobs: dict[int, Logprob]) -> None:
        """`seq` computed its last token; `logprobs` is the row its next token comes from."""
        self.rows[seq] = logprobs

    def is_ready(self, live: Iterable[BeamSequence]) -> bool:
        """Every live beam (`live`: the request's unfinished sequences) has offered its row."""
        return all(seq in self.rows for seq in live)

    def expand(self, live: list[BeamSequence]) -> dict[BeamSequence, list[Child]]:
        """One round: each live parent (in `live`'s order) and its kept children, best
        first; finished candidates are recorded. The rows are used up."""
        candidates = [child for seq in live for child in self._children(seq)]
        candidates.sort(key=lambda child: child.beam.cum_logprob, reverse=True)  # stable
        plan: dict[BeamSequence, list[Child]] = {seq: [] for seq in live}
        for child in candidates[: self.width]:
            if child.token_id in self.eos_token_ids and not self.ignore_eos:
                tokens = (*child.parent.output_token_ids, child.token_id)
                self.finished.append(FinishedBeam(tokens, child.beam, "stop", True))
            else:
                plan[child.parent].append(child)
        self.rows.clear()
        self.beams.clear()
        return plan

    def _children(self, seq: BeamSequence) -> list[Child]:
        """`seq` extended by each token of its row."""
        parent, row = self.beams.get(seq, Beam()), self.rows[seq]
        return [Child(seq, token_id, Beam(parent.cum_logprob + entry.logprob,
                                          (*parent.logprobs, row)))
                for token_id, entry in row.items()]

    def continue_as(self, seq: BeamSequence, beam: Beam) -> bool:
        """`seq` (its token appended) goes on as `beam`; False if it has reached its length
        (`max_tokens` or the model's), and so ended."""
        self.beams[seq] = beam
        num_outputs = len(seq.output_token_ids)
        if (self.max_tokens is not None and num_outputs >= self.max_tokens) or (
                self.prompt_len + num_outputs >= self.max_model_len):
            self.end(seq, "length")
            return False
        return True

    def end(self, seq: BeamSequence, finish_reason: str) -> None:
        """A live beam stops where it is: its length ran out (`max_tokens`, the model's, the
        whole pool's), or its request was aborted. A sequence that is no live beam (pruned, or
        never expanded) is no beam to keep."""
        self.rows.pop(seq, None)
        beam = self.beams.pop(seq, None)
        if beam is not None:
            self.finished.append(FinishedBeam(tuple(seq.output_token_ids), beam,
                                              finish_reason, False))

    def best(self, n: int) -> list[FinishedBeam]:
        """The `n` best finished beams by vLLM's length-penalised score, best first."""
        def score(done: FinishedBeam) -> float:
            length = self.prompt_len + len(done.token_ids) - done.ends_in_eos
            return done.beam.cum_logprob / length ** self.length_penalty

        return sorted(self.finished, key=score, reverse=True)[:n]

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants."""
        assert all(not seq.is_finished for seq in (*self.beams, *self.rows)), "a dead beam"
        assert self.beams.keys() >= self.rows.keys() or not self.has_expanded
        assert len(self.beams) <= self.width
