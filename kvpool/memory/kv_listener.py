"""The one door through which anything hears what KV memory does: `KVListener` and its fan-out.

The memory core owns this interface and never imports its observers. Each block pool holds a
`KVListeners` fan-out (empty by default, so an unobserved pool pays one call per event and no
branch); the device pool's fan-out is shared by everything on the device side (its sizing, the
tiers, the engine's KV cache manager), so a listener registered there once hears all of it:

    emitted by              events
    BlockPool               block_stored, block_evicted, pool_cleared
    ResizableBlockPool      block_removed (taken offline by an elastic shrink)
    ElasticKVPool           pool_resizing, pool_resized
    KVTiers                 block_spilled
    KVCacheManager          prefix_hit, blocks_allocated, blocks_freed, table_forked,
                            block_copied_on_write, sequence_preempted, sequence_swapped_in,
                            drafts_allocated, drafts_dropped
    the engine              request_arrived, request_finished, step_ended
    Scheduler               step_rolled_back

Listeners today: the tiers (`KVTiers` on the device pool: spill and write-through; the host
pool's host->disk spill), the KV event log, the `--kv-trace` recorder and the device pool's
rate window (`kvpool.memory.pool_rates`).

Invariants of `KVListeners`: each listener is registered at most once; every event reaches the
listeners that only observe (in registration order) before those that react by changing KV
memory (`reacts=True`, in registration order), so an observer hears an event before the
events it causes (a device eviction before the host store its spill makes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.memory.prefix_cache import BlockHash, CachedBlock


class KVListener:
    """What a listener may hear; every method does nothing, so a listener overrides only the
    events it needs. `medium` names the pool an event comes from ("device" or "host");
    a table event names its sequence by `request_id` and `index` (its completion index)."""

    # ------------------------------------------------------------ pool events
    def block_stored(self, medium: str, block_id: int, block_hash: BlockHash,
                     parent_hash: BlockHash | None, token_ids: Sequence[int]) -> None:
        """A full, computed block entered the pool's prefix cache (`parent_hash`: None for a
        first block, or where unknown)."""

    def block_evicted(self, medium: str, block_id: int, entry: CachedBlock,
                      is_kv_intact: bool) -> None:
        """A cached block was taken for reuse; its hash left the prefix cache. With
        `is_kv_intact` its KV is unchanged until the next step's copies (an allocation took
        it); without, an elastic shrink is copying a relocated block into it now."""

    def block_removed(self, medium: str, block_id: int, block_hash: BlockHash) -> None:
        """A cached block went offline with its pool's memory (an elastic shrink or reset)."""

    def pool_cleared(self, medium: str) -> None:
        """The pool is about to drop every hash it holds (a reset)."""

    def pool_resizing(self, medium: str) -> None:
        """An elastic grow, shrink or reset is about to relocate or zero blocks (on the
        compute stream): whoever has copies in flight that read or write the pool's KV must
        have that stream wait for them now."""

    def pool_resized(self, medium: str, num_online_blocks: int, delta: int,
                     moved: Mapping[int, int], dropped: Sequence[int]) -> None:
        """An elastic grow (`delta` > 0 blocks) or shrink (`delta` < 0): `moved` maps the used
        blocks relocated (old id -> new), `dropped` lists the cached blocks taken offline."""

    def block_spilled(self, block_id: int) -> None:
        """A device block being evicted is copied to the host tier."""

    # ----------------------------------------------------------- table events
    def prefix_hit(self, request_id: str, index: int, block_ids: Sequence[int],
                   num_cached_tokens: int, tokens_below: Mapping[str, int] | None) -> None:
        """A sequence's table retook `block_ids` from the device's prefix cache;
        `num_cached_tokens` were served in all, `tokens_below` per lower tier when one did."""

    def blocks_allocated(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        """A sequence's table took new blocks."""

    def blocks_freed(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        """A sequence's table dropped its references."""

    def drafts_allocated(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        """A sequence's table took new blocks for tentative slots (speculative drafts)."""

    def drafts_dropped(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        """Blocks that held only rejected drafts went back to the free list."""

    def table_forked(self, request_id: str, index: int, parent_index: int,
                     block_ids: Sequence[int]) -> None:
        """Completion `index` shares every block of completion `parent_index`."""

    def block_copied_on_write(self, request_id: str, index: int, src_block_id: int,
                              dst_block_id: int) -> None:
        """The shared block `src_block_id` was replaced by its private copy `dst_block_id` in
        the sequence's table."""

    def sequence_preempted(self, request_id: str, index: int, mode: str,
                           block_ids: Sequence[int]) -> None:
        """A running sequence lost its device blocks; `mode` "recompute" or "swap"."""

    def sequence_swapped_in(self, request_id: str, index: int,
                            block_ids: Sequence[int]) -> None:
        """A swapped sequence's host copies go back into new device blocks `block_ids`."""

    # ------------------------------------------------------ requests and steps
    def request_arrived(self, request_id: str, num_prompt_tokens: int, n: int,
                        block_hashes: Sequence[BlockHash]) -> None:
        """A request was queued: `n` completions of a prompt whose full blocks hash to
        `block_hashes`."""

    def request_finished(self, request_id: str, num_output_tokens: int, reason: str) -> None:
        """A request ended (its blocks are back): its longest completion's length and finish
        reason ("stop", "length", "abort")."""

    def step_ended(self, next_step: int) -> None:
        """The engine finished a step; later events belong to step `next_step`."""

    def step_rolled_back(self) -> None:
        """The step failed and was undone (`Scheduler.roll_back`): its sequences' blocks are
        freed (what the step published may be reused before the next step ends), and no
        `step_ended` follows for it."""


class KVListeners(KVListener):
    """An ordered fan-out: each event goes to every registered listener (module docstring)."""

    def __init__(self) -> None:
        self._observers: list[KVListener] = []
        self._reactors: list[KVListener] = []
        self._listeners: tuple[KVListener, ...] = ()  # observers, then reactors

    def add(self, listener: KVListener, *, reacts: bool = False) -> None:
        """Register `listener`; `reacts`: it changes KV memory when it hears (the tiers), so
        it hears after every observer."""
        assert listener not in self._listeners, "a listener is registered once"
        (self._reactors if reacts else self._observers).append(listener)
        self._listeners = (*self._observers, *self._reactors)

    def remove(self, listener: KVListener) -> None:
        """Unregister `listener` (ValueError if it is not registered)."""
        if listener in self._observers:
            self._observers.remove(listener)
        else:
            self._reactors.remove(listener)
        self._listeners = (*self._observers, *self._reactors)

    def __iter__(self) -> Iterator[KVListener]:
        return iter(self._listeners)

    def __len__(self) -> int:
        return len(self._listeners)

    def __contains__(self, listener: object) -> bool:
        return listener in self._listeners

    # ------------------------------------------------------------ pool events
    def block_stored(self, medium: str, block_id: int, block_hash: BlockHash,
                     parent_hash: BlockHash | None, token_ids: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.block_stored(medium, block_id, block_hash, parent_hash, token_ids)

    def block_evicted(self, medium: str, block_id: int, entry: CachedBlock,
                      is_kv_intact: bool) -> None:
        for listener in self._listeners:
            listener.block_evicted(medium, block_id, entry, is_kv_intact)

    def block_removed(self, medium: str, block_id: int, block_hash: BlockHash) -> None:
        for listener in self._listeners:
            listener.block_removed(medium, block_id, block_hash)

    def pool_cleared(self, medium: str) -> None:
        for listener in self._listeners:
            listener.pool_cleared(medium)

    def pool_resizing(self, medium: str) -> None:
        for listener in self._listeners:
            listener.pool_resizing(medium)

    def pool_resized(self, medium: str, num_online_blocks: int, delta: int,
                     moved: Mapping[int, int], dropped: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.pool_resized(medium, num_online_blocks, delta, moved, dropped)

    def block_spilled(self, block_id: int) -> None:
        for listener in self._listeners:
            listener.block_spilled(block_id)

    # ----------------------------------------------------------- table events
    def prefix_hit(self, request_id: str, index: int, block_ids: Sequence[int],
                   num_cached_tokens: int, tokens_below: Mapping[str, int] | None) -> None:
        for listener in self._listeners:
            listener.prefix_hit(request_id, index, block_ids, num_cached_tokens, tokens_below)

    def blocks_allocated(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.blocks_allocated(request_id, index, block_ids)

    def blocks_freed(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.blocks_freed(request_id, index, block_ids)

    def drafts_allocated(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.drafts_allocated(request_id, index, block_ids)

    def drafts_dropped(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.drafts_dropped(request_id, index, block_ids)

    def table_forked(self, request_id: str, index: int, parent_index: int,
                     block_ids: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.table_forked(request_id, index, parent_index, block_ids)

    def block_copied_on_write(self, request_id: str, index: int, src_block_id: int,
                              dst_block_id: int) -> None:
        for listener in self._listeners:
            listener.block_copied_on_write(request_id, index, src_block_id, dst_block_id)

    def sequence_preempted(self, request_id: str, index: int, mode: str,
                           block_ids: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.sequence_preempted(request_id, index, mode, block_ids)

    def sequence_swapped_in(self, request_id: str, index: int,
                            block_ids: Sequence[int]) -> None:
        for listener in self._listeners:
            listener.sequence_swapped_in(request_id, index, block_ids)

    # ------------------------------------------------------ requests and steps
    def request_arrived(self, request_id: str, num_prompt_tokens: int, n: int,
                        block_hashes: Sequence[BlockHash]) -> None:
        for listener in self._listeners:
            listener.request_arrived(request_id, num_prompt_tokens, n, block_hashes)

    def request_finished(self, request_id: str, num_output_tokens: int, reason: str) -> None:
        for listener in self._listeners:
            listener.request_finished(request_id, num_output_tokens, reason)

    def step_ended(self, next_step: int) -> None:
        for listener in self._listeners:
            listener.step_ended(next_step)

    def step_rolled_back(self) -> None:
        for listener in self._listeners:
            listener.step_rolled_back()
