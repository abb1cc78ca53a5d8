"""A counted suffix trie of bounded depth: every substring of up to `max_depth` tokens of the
texts it holds, each with how many times it occurs. Suffix decoding drafts from it.

A node is a substring; its children are the tokens that followed it, and `count` is how many
times it occurred. Adding a text of n tokens costs O(n · max_depth) steps and at most as many
nodes (shared substrings share nodes); removing it walks the same paths and subtracts, deleting
nodes whose count reaches 0, so the trie is always exactly the sum of the texts it holds.

`longest_match` finds the node of the longest suffix of a context that occurs in the trie, by
binary search over the suffix length: if a suffix occurs, so do all its own suffixes (they are
substrings of the same texts), so occurrence is monotone in the length and O(log depth) walks
of O(depth) suffice. `continuation` then follows the most frequent child while the path's
probability (the product of child count over parent count) stays above a floor.

Invariants (`check`): a node's count is at least the sum of its children's (a substring also
occurs where the text ends right after it); no node has count 0 (removal deletes them); the
root's count is the number of tokens held; depth never exceeds `max_depth`.
"""

from __future__ import annotations

from collections.abc import Sequence


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


class SuffixTrie:
    """Counted substrings (up to `max_depth` tokens) of the texts added and not yet removed."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 1

    def add(self, tokens: Sequence[int]) -> None:
        """Count every substring of `tokens` of up to `max_depth` tokens."""
        self._walk(tokens, +1)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)` (the same tokens were added before)."""
        self._walk(tokens, -1)

    def _walk(self, tokens: Sequence[int], sign: int) -> None:
        for start in range(len(tokens)):
            node = self.root
            node.count += sign
            for token in tokens[start : start + self.max_depth]:
                node = self._step(node, token, sign)

    def _step(self, node: Node, token: int, sign: int) -> Node:
        """The child `token` of `node`, its count changed by `sign` (made or deleted as its
        count leaves or reaches 0)."""
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = Node()
            self.num_nodes += 1
        child.count += sign
        if child.count == 0:
            del node.children[token]
            self.num_nodes -= 1
        return child

    def find(self, tokens: Sequence[int]) -> Node | None:
        node = self.root
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def longest_match(self, context: Sequence[int]) -> tuple[int, Node]:
        """(length, node) of the longest suffix of `context` (at most `max_depth - 1` tokens,
        so a continuation can follow) that occurs; (0, root) if none does."""
        low, high, best = 0, min(len(context), self.max_depth - 1), self.root
        while low < high:  # invariant: the suffix of `low` tokens occurs (best is its node)
            middle = (low + high + 1) // 2
            node = self.find(context[len(context) - middle :])
            if node is None:
                high = middle - 1
            else:
                low, best = middle, node
        return low, best

    def continuation(self, node: Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent path below `node`, up to `max_tokens` tokens, stopping before the
        path's probability would fall below `min_prob`; (tokens, its probability)."""
        tokens, prob = [], 1.0
        while len(tokens) < max_tokens and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            step = child.count / node.count
            if prob * step < min_prob:
                break
            tokens.append(token)
            prob *= step
            node = child
        return tokens, prob

    def check(self) -> None:
        """Assert the module's invariants (tests)."""
        stack, seen = [(self.root, 0)], 0
        while stack:
            node, depth = stack.pop()
            seen += 1
            assert depth <= self.max_depth
            assert node is self.root or node.count > 0
            assert node.count >= sum(child.count for child in node.children.values())
            stack.extend((child, depth + 1) for child in node.children.values())
        assert seen == self.num_nodes
