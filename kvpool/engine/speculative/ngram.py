"""Prompt lookup (vLLM's "ngram" method): draft the tokens that followed the latest earlier
occurrence of the context's last n tokens.

For n from `max_n` down to `min_n`, the context's last n tokens are looked up among the
earlier n-grams of the prompt and the outputs so far; the first n that matches proposes the
k tokens after its latest occurrence (fewer where the context ends sooner). Grounded work
(repeating, correcting, editing, quoting) reproduces long runs of its input, so most of these
drafts are right.

The lookup costs O(new tokens) a step, not a rescan of the context: each sequence keeps an
`NgramIndex` that learns the n-grams of its tokens once, as they arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.engine.sequence import Sequence as Seq

TokenRange = Callable[[int, int], Sequence[int]]  # (start, end) -> the context's tokens there


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a growing token list last occurred.

    Invariant: `_next[g]` is the position right after the latest occurrence of n-gram `g`
    among those ending before position `num_indexed`; n-grams ending at `num_indexed` or later
    are not yet learnt. Tuples of different lengths never collide, so one dict holds every n.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.num_indexed = 0
        self._next: dict[tuple[int, ...], int] = {}

    def learn(self, tokens: TokenRange, end: int) -> None:
        """Learn the n-grams ending before position `end` (not yet learnt)."""
        if end <= self.num_indexed:
            return
        first = max(self.num_indexed - self.max_n + 1, 0)
        window = tokens(first, end)  # every token an unlearnt n-gram needs, once
        for stop in range(self.num_indexed + 1, end + 1):  # n-grams ending at stop - 1
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self._next[tuple(window[stop - n - first : stop - first])] = stop
        self.num_indexed = end

    def propose(self, tokens: TokenRange, num_tokens: int, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest matching suffix's latest earlier
        occurrence in the first `num_tokens` tokens; [] when none matches."""
        return self.match(tokens, num_tokens, k)[1]

    def match(self, tokens: TokenRange, num_tokens: int, k: int) -> tuple[int, list[int]]:
        """`propose`'s drafts with the length of the suffix that matched (0: none)."""
        self.learn(tokens, num_tokens - 1)  # the suffix itself is not its own match
        suffix = tokens(max(num_tokens - self.max_n, 0), num_tokens)
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            start = self._next.get(tuple(suffix[len(suffix) - n:]))
            if start is not None:
                return n, list(tokens(start, min(start + k, num_tokens)))
        return 0, []


class NgramProposer:
    """Drafts for many sequences: one `NgramIndex` per sequence, forgotten at its end."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seq: Seq, k: int) -> list[int]:
        """Up to `k` drafts for `seq`'s next tokens ([]: no match)."""
        return self.match(seq, k)[1]

    def match(self, seq: Seq, k: int) -> tuple[int, list[int]]:
        """`propose`'s drafts with the length of the context suffix that matched."""
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = NgramIndex(self.min_n, self.max_n)
        return index.match(seq.token_ids, seq.num_tokens, k)

    def forget(self, seq: Seq) -> None:
        self._indexes.pop(seq.seq_id, None)
