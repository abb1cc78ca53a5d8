"""The scheduler's one window onto KV memory: admission arithmetic, slots, forks, frees.

The scheduler decides *who* runs; this class decides whether their blocks fit and takes them.
Keeping every pool call here leaves one place to change when KV can also live elsewhere: a
swap-to-host preemption mode replaces `preempt` (copy blocks out instead of dropping them) and
`admit` (copy them back), and the scheduler does not change.

Admission is planned once and carried out with the same prefix match: `plan_admission` looks
the waiting sequence's block hashes up in the prefix cache (no hashing: the sequence keeps its
hashes) and returns an `AdmissionPlan` holding the `PrefixMatch`; `admit` takes exactly those
blocks. Nothing can evict them in between: planning only grows the pool.

Admission keeps `watermark_blocks` free while others run, so running sequences can still grow
a block after new ones are let in; growth itself (`append_slots`) may use every block.

Before it reports that blocks do not fit, the manager asks KV memory to grow
(`KVMemory.grow_until_allocatable`): an elastic pool takes memory under pressure instead of
preempting a sequence or refusing admission. A static pool never grows, so this costs it
nothing. Growing only adds blocks; nothing already placed moves.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from kvpool.engine.sequence import Sequence
from kvpool.memory.block_table import BlockCopy, BlockTable
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.prefix_cache import PrefixMatch, hash_full_blocks


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """How a waiting sequence enters: reuse `prefix`, then compute `num_new_tokens`."""

    prefix: PrefixMatch
    num_new_tokens: int

    @property
    def num_cached_tokens(self) -> int:
        return self.prefix.num_cached_tokens


class KVCacheManager:
    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory
        self.pool = memory.pool
        self.layout = memory.layout

    def new_block_table(self, cache_salt: str | None) -> BlockTable:
        return BlockTable(self.pool, cache_salt)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the whole pool at its largest, alone."""
        return self.memory.can_ever_fit(num_tokens)

    def plan_admission(
        self, seq: Sequence, token_budget: int, allow_partial: bool, keep_watermark: bool
    ) -> AdmissionPlan | None:
        """The plan for admitting a waiting sequence now, or None if its blocks do not fit.

        The prefix lookup stops one token short of the end so that at least one token is
        computed: the step needs its logits. The watermark only matters when others run.
        """
        num_tokens = seq.num_tokens
        prefix = self.pool.match_prefix(seq.block_hashes, seq.token_ids(0, num_tokens - 1))
        num_new = num_tokens - prefix.num_cached_tokens
        if num_new > token_budget:
            if not allow_partial:
                return None
            num_new = token_budget
        needed = self.pool.num_blocks_to_admit(prefix, prefix.num_cached_tokens + num_new)
        if keep_watermark:
            needed += self.memory.watermark_blocks
        if not self.memory.grow_until_allocatable(needed):
            return None
        return AdmissionPlan(prefix, num_new)

    def admit(self, seq: Sequence, plan: AdmissionPlan) -> list[BlockCopy]:
        """Take the planned cached prefix and the slots of the first chunk."""
        prefix = plan.prefix
        cached_ids = seq.token_ids(0, prefix.num_cached_tokens)
        seq.num_computed_tokens = seq.block_table.take_prefix(prefix, cached_ids, seq.block_hashes)
        start = seq.num_computed_tokens
        return self.append_slots(seq, seq.token_ids(start, start + plan.num_new_tokens))

    def append_slots(self, seq: Sequence, new_token_ids: SequenceOf[int]) -> list[BlockCopy]:
        """Slots for `new_token_ids`, the sequence's next uncomputed tokens, growing KV memory
        if it must; OutOfBlocksError (it cannot grow enough) changes nothing."""
        try:  # the common case first: no extra work on the decode path
            return seq.block_table.append_tokens(new_token_ids, computed=False)
        except OutOfBlocksError:
            needed = seq.block_table.num_blocks_to_append(len(new_token_ids))
            if not self.memory.grow_until_allocatable(needed):
                raise
        return seq.block_table.append_tokens(new_token_ids, computed=False)

    def mark_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        seq.block_table.mark_computed(seq.num_computed_tokens, seq.block_hashes)

    def append_output(self, seq: Sequence, token_id: int) -> None:
        """A sampled token joins the sequence; a block it fills gets its hash now."""
        seq.output_token_ids.append(token_id)
        size = self.layout.block_size
        if seq.num_tokens % size == 0:
            hashes = seq.block_hashes
            unhashed = seq.token_ids(len(hashes) * size, seq.num_tokens)
            parent = hashes[-1] if hashes else None
            hashes.extend(hash_full_blocks(unhashed, size, seq.request.salt, parent))

    def fork(self, seq: Sequence) -> BlockTable:
        return seq.block_table.fork()

    def preempt(self, seq: Sequence) -> None:
        """Recompute mode: drop the sequence's KV; it is computed again when re-admitted.

        Its full blocks stay in the prefix cache, so re-admission often finds them again.
        """
        seq.block_table.free()
        seq.num_computed_tokens = 0

    def free(self, seq: Sequence) -> None:
        seq.block_table.free()
