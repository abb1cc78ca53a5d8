"""The counted suffix trie and the per-tenant output cache that suffix decoding drafts from."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.speculative.suffix import OutputCache
from kvpool.engine.speculative.suffix_tree import SuffixTrie

texts = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6)


def substring_counts(held: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for text in held:
        for start in range(len(text)):
            for end in range(start + 1, min(start + depth, len(text)) + 1):
                counts[tuple(text[start:end])] += 1
    return counts


def trie_counts(trie: SuffixTrie) -> Counter:
    counts: Counter = Counter()
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            counts[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return counts


@settings(max_examples=200, deadline=None)
@given(added=texts, removals=st.lists(st.integers(0, 5), max_size=6), depth=st.integers(2, 5))
def test_the_trie_counts_exactly_the_substrings_of_the_texts_it_holds(added, removals, depth):
    trie, held = SuffixTrie(depth), []
    for text in added:
        trie.add(text)
        held.append(text)
    for index in removals:
        if held:
            trie.remove(held.pop(index % len(held)))
        trie.check()
        assert trie_counts(trie) == substring_counts(held, depth)
    assert trie.root.count == sum(map(len, held))


@settings(max_examples=200, deadline=None)
@given(added=texts, context=st.lists(st.integers(0, 3), max_size=8), depth=st.integers(2, 5))
def test_longest_match_is_the_longest_suffix_that_occurs(added, context, depth):
    trie = SuffixTrie(depth)
    for text in added:
        trie.add(text)
    counts = substring_counts(added, depth)
    expected = max((n for n in range(1, min(len(context), depth - 1) + 1)
                    if tuple(context[len(context) - n:]) in counts), default=0)
    length, node = trie.longest_match(context)
    assert length == expected
    assert node is trie.find(context[len(context) - length:])


def test_continuation_follows_the_most_frequent_path_above_the_floor():
    trie = SuffixTrie(6)
    for text in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]):
        trie.add(text)
    node = trie.find([1])
    assert trie.continuation(node, 5, 0.0) == ([2, 3, 4], 0.5)  # 4 of 4, then 3 of 4, 2 of 3
    assert trie.continuation(node, 5, 0.6)[0] == [2, 3]  # 0.5 falls below the floor
    assert trie.continuation(node, 1, 0.0)[0] == [2]


def test_the_cache_keeps_tenants_apart_and_evicts_the_oldest():
    cache = OutputCache(max_depth=4, max_requests=2)
    cache.add(1, b"a", [1, 2, 3])
    cache.add(2, b"b", [7, 8])
    assert cache.trie(b"a").find([1, 2, 3]) is not None
    assert cache.trie(b"b").find([1]) is None  # tenant b never sees tenant a's output
    cache.add(3, b"b", [9])  # the third output evicts the oldest, tenant a's only one
    assert cache.trie(b"a") is None and cache.num_requests == 2
    assert cache.trie(b"b").root.count == 3


def test_the_cache_stays_within_its_node_budget():
    cache = OutputCache(max_depth=4, max_requests=100, max_nodes=40)
    for key in range(20):
        cache.add(key, b"", list(range(key * 10, key * 10 + 6)))
        assert cache.num_nodes <= 40 or cache.num_requests == 1
    assert cache.num_requests < 20
