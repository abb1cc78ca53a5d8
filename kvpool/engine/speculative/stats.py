"""Speculative decoding's counters, with vLLM's names (`spec_decode_num_drafts`, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """What verification found since the last reset: drafts (one per sequence and step that
    drafted), draft tokens, accepted ones, and acceptances per draft position (position 0:
    the first draft of a step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted of drafted tokens (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafting step yields per sequence on average: the accepted drafts and the
        token verification always adds (vLLM's mean acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class SpecDecodeCounters:
    """The running counts behind `SpecDecodeStats`."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_pos))
