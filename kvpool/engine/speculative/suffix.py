"""Suffix decoding (vLLM's "suffix" method): drafts from the request's own context, as prompt
lookup finds them, or from what the same tenant's recent requests answered, whichever matches
the longer suffix of the context.

Agents, tools and pipelines send the same kinds of request again and again, and their answers
repeat across requests (the same JSON shapes, the same code, the same refusals), where prompt
lookup, which reads one request, finds nothing. `OutputCache` keeps the outputs of the last
`suffix_decoding_max_cached_requests` finished sequences in a counted suffix trie
(`suffix_tree.SuffixTrie`) **per tenant**: a request only ever drafts from its own tenant's
outputs (`Request.salt`, the prefix cache's salt), so how fast one tenant's tokens come never
depends on what another tenant was told. A sequence's drafts from the trie follow its most
frequent continuation of the longest matching suffix (up to `suffix_decoding_max_tree_depth -
1` tokens), no longer than `suffix_decoding_max_spec_factor` times the match, stopping where
the path's probability falls below `suffix_decoding_min_token_prob` (vLLM's fields and
defaults).

Memory: a cached output of n tokens holds at most n · depth trie nodes, fewer where outputs
repeat. Besides the request bound, the cache holds at most `MAX_CACHED_NODES` nodes in all
(about 100 bytes each in Python), evicting the oldest outputs first.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.engine.speculative.ngram import NgramProposer
from kvpool.engine.speculative.suffix_tree import SuffixTrie

if TYPE_CHECKING:
    from kvpool.engine.config.speculative import SpeculativeConfig
    from kvpool.engine.sequence import Sequence as Seq
    from kvpool.memory.prefix_cache import SaltKey

MAX_CACHED_NODES = 1 << 21


class OutputCache:
    """Finished sequences' outputs, a trie per tenant, oldest evicted first.

    Invariant: each tenant's trie holds exactly the outputs in `_held` with its salt, and
    `len(_held) <= max_requests`, and the tries' nodes stay within `max_nodes` but for the one
    output just added (an output is never cut in part).
    """

    def __init__(self, max_depth: int, max_requests: int,
                 max_nodes: int = MAX_CACHED_NODES) -> None:
        self.max_depth, self.max_requests, self.max_nodes = max_depth, max_requests, max_nodes
        self._tries: dict[SaltKey, SuffixTrie] = {}
        self._held: OrderedDict[int, tuple[SaltKey, tuple[int, ...]]] = OrderedDict()

    def add(self, key: int, salt: SaltKey, tokens: Sequence[int]) -> None:
        """Cache a finished sequence's output under its tenant (`key`: the sequence's id)."""
        if not tokens or key in self._held:
            return
        trie = self._tries.get(salt)
        if trie is None:
            trie = self._tries[salt] = SuffixTrie(self.max_depth)
        trie.add(tokens)
        self._held[key] = (salt, tuple(tokens))
        while len(self._held) > 1 and (len(self._held) > self.max_requests
                                       or self.num_nodes > self.max_nodes):
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, (salt, tokens) = self._held.popitem(last=False)
        trie = self._tries[salt]
        trie.remove(tokens)
        if trie.root.count == 0:
            del self._tries[salt]

    @property
    def num_nodes(self) -> int:
        return sum(trie.num_nodes for trie in self._tries.values())

    @property
    def num_requests(self) -> int:
        return len(self._held)

    def trie(self, salt: SaltKey) -> SuffixTrie | None:
        """The tenant's trie; None if it has no cached output."""
        return self._tries.get(salt)


class SuffixProposer:
    """Prompt lookup within the sequence, or the tenant's cached outputs: the longer match."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lookup = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.cache = OutputCache(config.suffix_decoding_max_tree_depth,
                                 config.suffix_decoding_max_cached_requests)
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob

    def propose(self, seq: Seq, k: int) -> list[int]:
        """Up to `k` drafts for `seq`'s next tokens ([]: no match)."""
        local_length, local = self.lookup.match(seq, k)
        cached_length, cached = self._from_cache(seq, k)
        return cached if cached_length > local_length else local

    def _from_cache(self, seq: Seq, k: int) -> tuple[int, list[int]]:
        trie = self.cache.trie(seq.request.salt)
        if trie is None:
            return 0, []
        end = seq.num_tokens
        length, node = trie.longest_match(seq.token_ids(max(end - trie.max_depth + 1, 0), end))
        if not length:
            return 0, []
        limit = min(k, math.floor(self.max_spec_factor * length))
        return length, trie.continuation(node, limit, self.min_token_prob)[0]

    def forget(self, seq: Seq) -> None:
        """The sequence ended: its output joins its tenant's cache."""
        self.lookup.forget(seq)
        self.cache.add(seq.seq_id, seq.request.salt, seq.output_token_ids)
