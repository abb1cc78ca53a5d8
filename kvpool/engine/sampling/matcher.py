"""What the engine needs of a grammar matcher, as protocols: the sampler's view (`TokenMask`)
and the whole of it, as a request holds it and the stop rules read it (`Matcher`).

A leaf module (it imports nothing of kvpool), so that the request records, the sampler's rows
and the matchers themselves (`grammar.GrammarMatcher`, `after_thinking.AfterThinking`) can all
name these types without importing one another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class TokenMask(Protocol):
    """What the sampler needs of a grammar matcher: it fills the matcher's row of the bitmask
    before choosing, and advances it by the chosen token after. A drafted chunk's rows walk it
    through the drafts between fills and rewind it (`constraints.fill_grammar_rows`); the
    speculator walks and rewinds it to cut drafts."""

    def rewind_to(self, num_tokens: int) -> None:
        """Forget tokens accepted beyond the first `num_tokens` outputs (a step rolled back
        after the sampler ran, whose tokens the sequence never got)."""
        ...

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Set `bitmask[row]`'s bits of the allowed tokens; False if the row allows all."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance by the chosen token; False if the grammar does not allow it."""
        ...

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (the sequence's outputs between steps)."""
        ...

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended: no token is accepted after this."""
        ...


class Matcher(TokenMask, Protocol):
    """One constrained completion's matcher: the sampler's `TokenMask`, and what the stop
    rules ask of it (`kvpool.engine.requests.output_processor`)."""

    def has_rejected(self, num_outputs: int) -> bool:
        """The sequence's `num_outputs`-th output token is one the grammar rejected."""
        ...

    def has_ended(self, num_outputs: int) -> bool:
        """The grammar ended within the sequence's first `num_outputs` output tokens."""
        ...
