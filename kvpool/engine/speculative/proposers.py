"""What drafts tokens for the speculator (`Proposer`), and the one for each method."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvpool.engine.speculative.ngram import NgramProposer
from kvpool.engine.speculative.suffix import SuffixProposer

if TYPE_CHECKING:
    from kvpool.engine.config.speculative import SpeculativeConfig
    from kvpool.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` guesses at `seq`'s next tokens ([]: none worth verifying)."""
        ...

    def forget(self, seq: Sequence) -> None:
        """`seq` ended (finished or aborted): drop what was kept for it."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "suffix":
        return SuffixProposer(config)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
