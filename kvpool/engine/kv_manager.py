"""The scheduler's one window onto KV memory: admission arithmetic, slots, forks, frees,
preemption, and the tiers below the device pool.

The scheduler decides *who* runs; this class decides whether their blocks fit and takes them,
and where a preempted sequence's KV goes: dropped (recompute), or copied to host blocks the
sequence owns while it waits (swap; `kvpool.engine.preemption` chooses). A swapped sequence
keeps its `num_computed_tokens`; re-admitting it retakes its leading blocks still cached on
the device, copies the rest back, and it goes on where it stopped.

A prefix lookup walks the tiers: the device's prefix cache, then the host tier's, the disk's,
then the shared tier in Redis (`KVTiers.find_below`), block by block while the hash chain
matches. Disk and shared blocks are read and validated once the admission is known to fit (so
a sequence that waits, re-planned every step, fetches no block's bytes); what is found below
the device is copied into new device blocks before the step's model runs, and counted per tier
(`kvpool.memory.tiers.kv_tiers.TIERS`).

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

The device side's listeners (`KVMemory.listeners`, `kvpool.memory.kv_listener`; the
`--kv-trace` recorder) hear of every reference a sequence's table takes or drops: hits, new
blocks, copies-on-write, forks, frees, preemptions and swap-ins, one fan-out call each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.engine.preemption import RECOMPUTE, SWAP, PreemptionPolicy
from kvpool.engine.requests.prompt_logprobs import pending_positions
from kvpool.engine.sequence import Sequence
from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.block_table import BlockCopy, BlockTable
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.group_tables import GroupBlockTables
from kvpool.memory.hybrid_memory import HybridKVMemory
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.prefix_cache import PrefixMatch, hash_full_blocks
from kvpool.memory.tiers.group_tiers import GroupTierMatch
from kvpool.memory.tiers.kv_tiers import TIERS, SwappedKV
from kvpool.memory.tiers.tier_match import TierMatch


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """How a waiting sequence enters: reuse `prefix` (device blocks) and `below` (host, disk
    and shared blocks, copied up), or copy back its own swapped-out blocks; then compute
    `num_new_tokens`."""

    prefix: PrefixMatch
    num_new_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix caches of every tier
    below: TierMatch | GroupTierMatch = field(default_factory=TierMatch)
    swapped: SwappedKV | None = None


@dataclass(slots=True)
class SwapCounters:
    """Preemptions by kind, and what swapping moved (blocks, bytes = blocks × bytes/block)."""

    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_recompute_tokens_avoided: int = 0
    # Prompt tokens served per tier, at each request's first admission (so they sum to the
    # requests' `num_cached_tokens`; a re-admission's hits are the pools' hit counters').
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))


class KVCacheManager:
    def __init__(self, memory: KVMemory | HybridKVMemory,
                 policy: PreemptionPolicy | None = None) -> None:
        self.memory = memory
        self.pool = memory.pool
        self.layout = memory.layout
        self.tiers = memory.tiers
        self.policy = policy or PreemptionPolicy(RECOMPUTE, self.layout.bytes_per_block,
                                                 lambda num_tokens: 0.0)
        self.counters = SwapCounters()
        self._swapped: dict[int, SwappedKV] = {}  # seq_id -> the host blocks it owns
        self.listeners = memory.listeners

    def new_block_table(self) -> BlockTable | GroupBlockTables:
        """An empty table: one per KV cache group where the memory has several."""
        return self.memory.new_block_table()

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the whole pool at its largest, alone."""
        return self.memory.can_ever_fit(num_tokens)

    def plan_admission(
        self, seq: Sequence, token_budget: int, allow_partial: bool, keep_watermark: bool
    ) -> AdmissionPlan | None:
        """The plan for admitting a waiting sequence now, or None if its blocks do not fit.

        The prefix lookup stops one token short of the end so that at least one token is
        computed: the step needs its logits; for a request still owed prompt logprobs, it
        stops where they do (`_num_query_tokens`). The watermark only matters when others run.
        Disk and shared blocks are read (and validated) only once the plan is known to fit.
        """
        if seq.seq_id in self._swapped:
            return self._plan_swap_in(seq, token_budget, allow_partial, keep_watermark)
        query = seq.token_ids(0, _num_query_tokens(seq))
        prefix = self.memory.match_prefix(seq.block_hashes, query)
        first_below = len(prefix.block_ids)
        below = self.tiers.find_below(seq.block_hashes, query, first_below,
                                      prefix.num_query_blocks)
        size = self.layout.block_size
        num_cached = prefix.num_cached_tokens + below.num_blocks * size
        num_new = _num_new_tokens(seq.num_tokens - num_cached, token_budget, allow_partial)
        if num_new is None:
            return None
        needed = self.memory.blocks_to_admit(prefix, num_cached + num_new)
        if not self.memory.grow_until_allocatable(needed, keep_watermark):
            if keep_watermark or not prefix.num_cached_tokens:
                return None
            # Alone, a sequence always fits without its hit: a hybrid pool's cached pages
            # may be what keeps it from placing a page of another size.
            prefix = self.memory.match_prefix(seq.block_hashes, query[:0])
            num_cached, below = 0, TierMatch()
            num_new = _num_new_tokens(seq.num_tokens, token_budget, allow_partial)
            if num_new is None or not self.memory.grow_until_allocatable(
                    self.memory.blocks_to_admit(prefix, num_new), keep_watermark):
                return None
        if below.num_blocks:
            self.tiers.validate(below, query, first_below)
            num_cached = prefix.num_cached_tokens + below.num_blocks * size
            num_new = _num_new_tokens(seq.num_tokens - num_cached, token_budget, allow_partial)
            if num_new is None:
                return None
        return AdmissionPlan(prefix, num_new, num_cached, below)

    def _plan_swap_in(self, seq: Sequence, token_budget: int, allow_partial: bool,
                      keep_watermark: bool) -> AdmissionPlan | None:
        """Its swapped blocks come back, except the leading ones still cached on the device
        (taken from there: no copy, no duplicate)."""
        num_new = _num_new_tokens(seq.num_uncomputed_tokens, token_budget, allow_partial)
        if num_new is None:
            return None
        swapped = self._swapped[seq.seq_id]
        prefix, needed = self.memory.plan_swap_in(
            swapped, seq.block_hashes, seq.token_ids(0, seq.num_computed_tokens),
            seq.num_computed_tokens + num_new)
        if not self.memory.grow_until_allocatable(needed, keep_watermark):
            return None
        return AdmissionPlan(prefix, num_new, 0, swapped=swapped)

    def admit(self, seq: Sequence, plan: AdmissionPlan) -> list[BlockCopy]:
        """Take the planned cached prefix (copying up what was found below the device), or
        copy the sequence's swapped blocks back; then the slots of the first chunk."""
        served = None
        if plan.swapped is not None:
            self._swap_in(seq, plan)
        else:
            served = self._take_cached_prefix(seq, plan)
        self._report_admission(seq, plan, served)
        return self.append_slots(seq, plan.num_new_tokens)

    def _take_cached_prefix(self, seq: Sequence, plan: AdmissionPlan) -> dict[str, int]:
        """The planned prefix taken; returns the prompt tokens each tier served."""
        prefix, table = plan.prefix, seq.block_table
        seq.num_computed_tokens = table.take_prefix(prefix)
        counts = {"device": prefix.num_cached_tokens}
        if plan.below.num_blocks:
            self.tiers.hold(plan.below)  # before allocating: that may spill into the host tier
            table.append_slots(plan.num_cached_tokens - seq.num_computed_tokens)
            reloaded = self.memory.reload(plan.below, table, len(prefix.block_ids))
            for tier, num_blocks in reloaded.items():
                counts[tier] = num_blocks * self.layout.block_size
            seq.num_computed_tokens = plan.num_cached_tokens
            table.mark_computed(seq.num_computed_tokens, seq.token_ids, seq.block_hashes)
        if seq.request.num_cached_tokens is None:  # a request's cached tokens count once
            for tier, num_tokens in counts.items():
                self.counters.cached_tokens_by_tier[tier] += num_tokens
        return counts

    def _report_admission(self, seq: Sequence, plan: AdmissionPlan,
                          served: dict[str, int] | None) -> None:
        """The admission's events before its first chunk's slots: a hit for the blocks
        retaken from the device's prefix cache, then the blocks newly taken, as copies from
        the tiers below (alloc) or of its own swapped-out blocks (swap_in; `served` None)."""
        listeners, block_ids = self.listeners, seq.block_table.block_ids
        request_id, index = seq.request.request_id, seq.index
        num_reused = len(plan.prefix.block_ids)
        if served is None:
            if num_reused:
                listeners.prefix_hit(request_id, index, _held(block_ids[:num_reused]),
                                     plan.prefix.num_cached_tokens, None)
            listeners.sequence_swapped_in(request_id, index, block_ids[num_reused:])
            return
        if plan.num_cached_tokens:
            below = {tier: served.get(tier, 0) for tier in TIERS[1:]}
            listeners.prefix_hit(request_id, index, _held(block_ids[:num_reused]),
                                 plan.num_cached_tokens, below if any(below.values()) else None)
        if len(block_ids) > num_reused:
            listeners.blocks_allocated(request_id, index, block_ids[num_reused:])

    def _swap_in(self, seq: Sequence, plan: AdmissionPlan) -> None:
        """The device-cached leading blocks retaken (`plan.prefix`), new device blocks for the
        rest with the host copies queued into them (`KVMemory.swap_in`)."""
        swapped = self._swapped.pop(seq.seq_id)
        table = seq.block_table
        self.memory.swap_in(table, swapped, plan.prefix, seq.num_computed_tokens)
        table.mark_computed(seq.num_computed_tokens, seq.token_ids, seq.block_hashes)
        self.counters.num_swapped_in_blocks += swapped.num_blocks - len(
            _held(plan.prefix.block_ids))
        self.counters.num_recompute_tokens_avoided += seq.num_computed_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
        """Slots for the sequence's next `num_new_tokens` uncomputed tokens, growing KV memory
        if it must; OutOfBlocksError (it cannot grow enough) changes nothing but the blocks a
        sliding window no longer reads, released first (so they count as allocatable)."""
        table = seq.block_table
        if num_new_tokens > 0 and (dropped := table.drop_dead_blocks()):
            # A sliding window's blocks no query reads again: gone from the table now.
            self.listeners.blocks_freed(seq.request.request_id, seq.index, dropped)
        num_blocks = table.num_blocks
        copies = self._append_slots(table, num_new_tokens)
        for copy in copies:
            if copy.group:  # events and statistics follow the first group (`pool`)
                continue
            self.listeners.block_copied_on_write(seq.request.request_id, seq.index,
                                                 copy.src_block_id, copy.dst_block_id)
        if table.num_blocks > num_blocks:  # a copy-on-write replaces the last block in place
            self.listeners.blocks_allocated(seq.request.request_id, seq.index,
                                            table.block_ids[num_blocks:])
        return copies

    def _append_slots(self, table: BlockTable | GroupBlockTables,
                      num_new_tokens: int) -> list[BlockCopy]:
        try:  # the common case first: no extra work on the decode path
            return table.append_slots(num_new_tokens)
        except OutOfBlocksError:
            if not self.memory.grow_until_allocatable(self.memory.demand(table, num_new_tokens)):
                raise
        return table.append_slots(num_new_tokens)

    def append_drafts(self, seq: Sequence, num_draft_tokens: int) -> list[BlockCopy] | None:
        """Tentative slots for drafts after the step's tokens, from free blocks only: a draft
        never evicts a cached block, grows KV memory or preempts anyone (None: no room, no
        drafts)."""
        table = seq.block_table
        num_blocks = table.num_blocks
        if not self.memory.has_free_blocks(self.memory.demand(table, num_draft_tokens)):
            return None
        copies = table.append_tentative_slots(num_draft_tokens)
        if table.num_blocks > num_blocks:
            self.listeners.drafts_allocated(seq.request.request_id, seq.index,
                                            table.block_ids[num_blocks:])
        return copies

    def commit_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """Keep the slots of the first `num_accepted` drafts; the others vanish, and blocks
        that held only them go back to the free list now."""
        dropped = seq.block_table.commit_tentative(num_accepted)
        if dropped:
            self.listeners.drafts_dropped(seq.request.request_id, seq.index, dropped)

    def mark_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        seq.block_table.mark_computed(seq.num_computed_tokens, seq.token_ids, seq.block_hashes)

    def append_output(self, seq: Sequence, token_id: int) -> None:
        """A sampled token joins the sequence; a block it fills gets its hash now."""
        seq.output_token_ids.append(token_id)
        size = self.layout.block_size
        if seq.num_tokens % size == 0:
            hashes = seq.block_hashes
            unhashed = seq.token_ids(len(hashes) * size, seq.num_tokens)
            parent = hashes[-1] if hashes else None
            hashes.extend(hash_full_blocks(unhashed, size, seq.request.salt, parent))

    def fork(self, seq: Sequence) -> BlockTable | GroupBlockTables:
        """A table sharing all of `seq`'s blocks, for the request's next sequence (the
        scheduler gives it index `len(request.sequences)`: the recorder names it so)."""
        child = seq.block_table.fork()
        self.listeners.table_forked(seq.request.request_id, len(seq.request.sequences),
                                    seq.index, child.live_block_ids)
        return child

    def preempt(self, seq: Sequence) -> str:
        """Take a running sequence's KV off the device; returns what became of it, "swap"
        (copied to host blocks it owns) or "recompute" (dropped; computed again when
        re-admitted, its full blocks kept in the prefix caches meanwhile). A sequence with
        nothing left to compute (a beam waiting for its round) is dropped: swapped back in, it
        would be admitted with no token to compute."""
        table = seq.block_table
        kind = RECOMPUTE
        if self.tiers.has_host and 0 < seq.num_computed_tokens < seq.num_tokens:
            kind = self.policy.choose(table.num_blocks, seq.num_computed_tokens)
        swapped = self.memory.swap_out(table) if kind == SWAP else None
        self.listeners.sequence_preempted(seq.request.request_id, seq.index,
                                          RECOMPUTE if swapped is None else SWAP,
                                          table.live_block_ids)
        if swapped is None:
            self.counters.num_recompute_preemptions += 1
            self._drop(seq)
            return RECOMPUTE
        self._swapped[seq.seq_id] = swapped
        self.counters.num_swap_preemptions += 1
        self.counters.num_swapped_out_blocks += swapped.num_blocks
        table.free()
        return SWAP

    def drop(self, seq: Sequence) -> None:
        """Drop the sequence's KV on the device (its computed tokens are computed again)."""
        self._report_free(seq)
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        seq.block_table.free()
        seq.num_computed_tokens = 0

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.seq_id in self._swapped

    def swapped_kv(self, seq: Sequence) -> SwappedKV | None:
        """The host blocks a swapped-out sequence owns (None for any other sequence)."""
        return self._swapped.get(seq.seq_id)

    @property
    def swapped(self) -> list[SwappedKV]:
        """What every swapped-out sequence holds on the host."""
        return list(self._swapped.values())

    def free(self, seq: Sequence) -> None:
        swapped = self._swapped.pop(seq.seq_id, None)
        if swapped is not None:
            self.memory.free_swapped(swapped)
        self._report_free(seq)
        seq.block_table.free()

    def _report_free(self, seq: Sequence) -> None:
        held = seq.block_table.live_block_ids
        if held:
            self.listeners.blocks_freed(seq.request.request_id, seq.index, held)

    def reset_counters(self) -> None:
        self.counters = SwapCounters()


def _held(block_ids: list[int]) -> list[int]:
    """The ids a table holds among `block_ids` (a sliding window's dropped ones left out)."""
    return [block_id for block_id in block_ids if block_id != NULL_BLOCK_ID]


def _num_query_tokens(seq: Sequence) -> int:
    """How many leading tokens a prefix lookup may serve: all but the last, and none of the
    positions still owed prompt logprobs (a cached position gives no logits). So a new request
    with prompt logprobs takes no cached prefix, as in vLLM; one preempted after some were
    computed may take back up to where they stop."""
    pending = pending_positions(seq.request)
    return min(seq.num_tokens - 1, pending.start) if pending else seq.num_tokens - 1


def _num_new_tokens(num_uncomputed: int, token_budget: int, allow_partial: bool) -> int | None:
    """Tokens the first chunk computes: all, or (chunked prefill) what the budget allows;
    None when they do not fit the budget and may not be split."""
    if num_uncomputed <= token_budget:
        return num_uncomputed
    return token_budget if allow_partial else None
