"""The scheduler's one window onto the block pool: admission arithmetic, slots, forks, frees.

The scheduler decides *who* runs; this class decides whether their blocks fit and takes them.
Keeping every pool call here leaves one place to change when KV can also live elsewhere: a
swap-to-host preemption mode replaces `preempt` (copy blocks out instead of dropping them) and
`admit` (copy them back), and the scheduler does not change.

Admission keeps `watermark_blocks` free while others run, so running sequences can still grow
a block after new ones are let in; growth itself (`append_slots`) may use every block.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.engine.sequence import Sequence
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.block_table import BlockCopy, BlockTable, cdiv


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """How a waiting sequence enters: reuse `num_cached_tokens`, then compute `num_new_tokens`."""

    num_cached_tokens: int
    num_new_tokens: int


class KVCacheManager:
    def __init__(self, pool: BlockPool, watermark_blocks: int = 0) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.watermark_blocks = watermark_blocks

    def new_block_table(self, cache_salt: str | None) -> BlockTable:
        return BlockTable(self.pool, cache_salt)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the whole pool, with nothing else running."""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

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
        if needed > self.pool.num_allocatable_blocks:
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
        """Slots for the next `num_new_tokens` tokens; OutOfBlocksError changes nothing."""
        start = seq.num_computed_tokens
        new_tokens = seq.token_ids(start, start + num_new_tokens)
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
