"""The scheduler's one window onto the block pool: admission arithmetic, slots, forks, frees.

The scheduler decides *who* runs; this class decides whether their blocks fit and takes them.
Keeping every pool call here leaves one place to change when KV can also live elsewhere: a
swap-to-host preemption mode replaces `preempt` (copy blocks out instead of dropping them) and
`admit` (copy them back), and the scheduler does not change.

Admission keeps `watermark_blocks` free while others run, so running sequences can still grow
a block after new ones are let in; growth itself (`append_slots`) may use every block.

Before it reports that blocks do not fit, the manager asks the KV pool to grow (`kv_pool.grow`,
a segment at a time, until they fit or the budget is spent): an elastic pool takes memory under
pressure instead of preempting a sequence or refusing admission. A static pool never grows, so
this costs it nothing. Growing only adds blocks; nothing already placed moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.engine.sequence import Sequence
from kvpool.memory.block_pool import BlockPool, OutOfBlocksError
from kvpool.memory.block_table import BlockCopy, BlockTable, cdiv
from kvpool.memory.elastic_pool import KVPool


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """How a waiting sequence enters: reuse `num_cached_tokens`, then compute `num_new_tokens`."""

    num_cached_tokens: int
    num_new_tokens: int


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, watermark_blocks: int = 0, kv_pool: KVPool | None = None
    ) -> None:
        """`kv_pool` (None: a pool of fixed size) is asked to grow when blocks run short."""
        self.pool = pool
        self.block_size = pool.block_size
        self.watermark_blocks = watermark_blocks
        self.kv_pool = kv_pool

    def new_block_table(self, cache_salt: str | None) -> BlockTable:
        return BlockTable(self.pool, cache_salt)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the whole pool at its largest, alone."""
        max_num_blocks = self.pool.num_blocks if self.kv_pool is None else (
            self.kv_pool.max_num_blocks)
        return cdiv(num_tokens, self.block_size) <= max_num_blocks

    def _grow_until_allocatable(self, num_blocks: int) -> bool:
        """Grow the KV pool until `num_blocks` blocks are allocatable; False if it cannot."""
        while self.pool.num_allocatable_blocks < num_blocks:
            if self.kv_pool is None or not self.kv_pool.grow():
                return False
        return True

    def plan_admission(
        self, seq: Sequence, token_budget: int, allow_partial: bool, keep_watermark: bool
    ) -> AdmissionPlan | None:
        """The plan for admitting a waiting sequence now, or None if its blocks do not fit.

        The prefix lookup stops one token short of the end so that at least one token is
        computed: the step needs its logits. The watermark only matters when others run.
        """
        tokens = seq.token_ids()
        hashes = seq.block_table.prefix_hashes(tokens[:-1])
        hit_ids = self.pool.match_prefix(hashes, tokens)
        num_cached = len(hit_ids) * self.block_size
        num_new = len(tokens) - num_cached
        if num_new > token_budget:
            if not allow_partial:
                return None
            num_new = token_budget
        num_new_blocks = cdiv(num_cached + num_new, self.block_size) - len(hit_ids)
        # Cached hits nobody holds sit in the evictable set: reviving them uses allocatable blocks.
        num_revived = sum(1 for block_id in hit_ids if self.pool.is_evictable(block_id))
        needed = num_new_blocks + num_revived + (self.watermark_blocks if keep_watermark else 0)
        if not self._grow_until_allocatable(needed):
            return None
        return AdmissionPlan(num_cached, num_new)

    def admit(self, seq: Sequence, plan: AdmissionPlan) -> list[BlockCopy]:
        """Take the cached prefix and the slots of the first chunk."""
        tokens = seq.token_ids()
        num_cached = seq.block_table.take_cached_prefix(tokens[:-1])
        assert num_cached == plan.num_cached_tokens, "the pool changed between plan and admit"
        seq.num_computed_tokens = num_cached
        return self.append_slots(seq, plan.num_new_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
        """Slots for the next `num_new_tokens` tokens, growing the KV pool if it must;
        OutOfBlocksError (the pool cannot grow enough) changes nothing."""
        start = seq.num_computed_tokens
        new_tokens = seq.token_ids(start, start + num_new_tokens)
        try:  # the common case first: no extra work on the decode path
            return seq.block_table.append_tokens(new_tokens, computed=False)
        except OutOfBlocksError:
            needed = seq.block_table.num_blocks_to_append(len(new_tokens))
            if not self._grow_until_allocatable(needed):
                raise
        return seq.block_table.append_tokens(new_tokens, computed=False)

    def mark_computed(self, seq: Sequence) -> None:
        seq.block_table.mark_computed(seq.num_computed_tokens)

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
