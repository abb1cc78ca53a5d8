"""KV cache groups: the layers that keep the same KV blocks, grouped by attention kind and window.

A layer with full attention reads every earlier token, so it keeps a block for every token. A
sliding-window layer (Gemma 2/3, Mistral, Phi-3, gpt-oss) reads only the last W tokens: a
token at position p attends to p - W + 1 .. p (`kvpool.attention.backend`'s convention), so
once the next query is at position q, every block whose tokens all lie before q - W + 1 is
dead for that layer. Layers that share a kind and a window share one group; each group gives
every sequence its own block table (`kvpool.memory.block_table.BlockTable` with the group's
window), and a group's block holds the KV of *its* layers only (`KVGroup.layout`, a
`KVLayout` whose `num_layers` is the group's). With the hybrid manager off there is one group
of every layer and no window: every layer keeps every block (attention still applies each
layer's window; only the freeing is off).

    Gemma 3 1B (26 layers, every sixth full, W = 512), 8k tokens, 16-token blocks:
      group 0  full      layers 5 11 17 23        512 blocks of 4 layers
      group 1  sliding   22 other layers          33 blocks of 22 layers (ceil(512/16) + 1)

Invariants: groups are disjoint and cover every layer once, in ascending order within a group;
the full-attention group (if any) comes first; `window` is None or >= 1; every group's layout
equals the model's layout but for `num_layers`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.memory.arena import BASE_ALIGNMENT
from kvpool.memory.arena_free_list import align_up
from kvpool.memory.kv_layout import KVLayout, cdiv

FULL, SLIDING = "full", "sliding"


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers sharing one attention span, and the layout of a block of their KV."""

    layers: tuple[int, ...]
    window: int | None  # tokens a query sees (itself included); None: every earlier token
    layout: KVLayout  # num_layers == len(layers)

    def __post_init__(self) -> None:
        if self.layout.num_layers != len(self.layers):
            raise ValueError(f"a group of {len(self.layers)} layers needs a layout of as many")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a window must be at least 1 token, got {self.window}")

    @property
    def kind(self) -> str:
        return FULL if self.window is None else SLIDING

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def page_bytes(self) -> int:
        """Bytes a block of this group takes in a hybrid pool's arena: its layout's, rounded
        up to the arena's base alignment (an int8 page of codes and scales seldom is one)."""
        return align_up(self.layout.bytes_per_block, BASE_ALIGNMENT)

    def first_live_block(self, next_position: int) -> int:
        """Index of the first block a query at `next_position` or later still reads; every
        block before it is dead for this group's layers (0 for full attention)."""
        if self.window is None:
            return 0
        return max(0, next_position - self.window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, num_query_tokens: int = 1) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds in this group during a step
        computing its last `num_query_tokens` (a decode: 1): every block from the first the
        step's earliest query reads to the last."""
        num_blocks = self.layout.num_blocks_for_tokens(num_tokens)
        return num_blocks - self.first_live_block(num_tokens - num_query_tokens)

    @property
    def max_live_blocks(self) -> int:
        """The bound a long decoding sequence's table stays within: ceil(W / block_size) + 1
        for a window (W tokens seldom start on a block boundary), unbounded (0) for full."""
        return 0 if self.window is None else cdiv(self.window, self.block_size) + 1


def kv_groups(layout: KVLayout, windows: Sequence[int | None], hybrid: bool = True,
              max_model_len: int | None = None) -> tuple[KVGroup, ...]:
    """The groups of a model whose layer i has window `windows[i]` (None: full attention).

    A window of at least `max_model_len` tokens never drops a block, so it counts as full
    attention. `hybrid=False` (vLLM's `disable_hybrid_kv_cache_manager`) makes one full group of
    every layer."""
    if len(windows) != layout.num_layers:
        raise ValueError(f"{len(windows)} windows for {layout.num_layers} layers")
    if max_model_len is not None:
        windows = [None if w is not None and w >= max_model_len else w for w in windows]
    if not hybrid:
        windows = [None] * len(windows)
    order = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # full first
    groups = []
    for window in order:
        layers = tuple(i for i, w in enumerate(windows) if w == window)
        group_layout = dataclasses.replace(layout, num_layers=len(layers))
        groups.append(KVGroup(layers, window, group_layout))
    return tuple(groups)


def bytes_for_tokens(groups: Sequence[KVGroup], num_tokens: int,
                     num_query_tokens: int = 1) -> int:
    """KV bytes one sequence of `num_tokens` tokens holds, summed over the groups, during a
    step computing its last `num_query_tokens`."""
    return sum(group.max_blocks_held(num_tokens, num_query_tokens) * group.page_bytes
               for group in groups)


def max_concurrency(groups: Sequence[KVGroup], num_bytes: int, max_model_len: int) -> float:
    """How many sequences of `max_model_len` tokens, each decoding, `num_bytes` of KV hold at
    once: vLLM's "maximum concurrency", from the groups (with one group of every layer it is
    `KVLayout.max_concurrency`'s tokens / max_model_len, rounded down to whole blocks)."""
    return num_bytes / bytes_for_tokens(groups, max_model_len)


def page_rows(num_bytes: int, page_bytes: int, unit: int) -> int:
    """Ids b whose page of `page_bytes` at offset b * `unit` lies within `num_bytes`: the rows of
    a group's strided view of a hybrid pool's buffer (`kvpool.memory.group_kv_cache`)."""
    return (num_bytes - page_bytes) // unit + 1
