"""Continuous batching: every step, pick which tokens of which sequences to compute.

One step's batch, formed by `schedule()`:

1. Running sequences, in priority order: each gets its remaining tokens (one for a decode, a
   chunk for an unfinished prefill) while the token budget lasts. When the pool has no block
   for one of them, the lowest-priority, latest-arriving running sequence is preempted (its
   KV dropped, itself requeued for recomputation) until the block fits, possibly the sequence
   itself.
2. Waiting sequences, in priority order, while the budget, `max_num_seqs` and memory allow:
   admitted with their prefix-cache hit and a first chunk (or their whole prompt when chunked
   prefill is off). Admission stops at the first that does not fit (no overtaking), and no one
   is admitted in a step that had to preempt.

Invariants: `running` and `waiting` are sorted by `Sequence.sort_key`; a sequence is in at most
one of them; every running sequence holds exactly the blocks of its computed tokens between
steps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvpool.memory.block_pool import OutOfBlocksError
from kvpool.memory.block_table import BlockCopy


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `seq`, after its first `num_computed_tokens`.

    `completes_sequence`: the chunk reaches the sequence's last token, so its logits sample the
    next one (fixed when scheduled: the sequence grows once the step is done).
    """

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    completes_sequence: bool

    @classmethod
    def next_tokens(cls, seq: Sequence, num_new_tokens: int) -> ScheduledChunk:
        end = seq.num_computed_tokens + num_new_tokens
        return cls(seq, seq.num_computed_tokens, num_new_tokens, end == seq.num_tokens)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    length_capped: list[Sequence] = field(default_factory=list)  # outgrew the whole pool

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens dropped by preemption

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        token_budget = self._schedule_running(self.config.max_num_batched_tokens, output)
        if not output.preempted:
            self._schedule_waiting(token_budget, output)
        return output

    def _schedule_running(self, token_budget: int, output: SchedulerOutput) -> int:
        index = 0
        while (
            index < len(self.running)
            and token_budget > 0
            and len(output.chunks) < self.config.max_num_seqs
        ):
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, token_budget)
            copies = self._reserve_slots(seq, num_new, output)
            if copies is None:  # the sequence itself was preempted or capped
                continue
            output.block_copies.extend(copies)
            output.chunks.append(ScheduledChunk.next_tokens(seq, num_new))
            token_budget -= num_new
            index += 1
        return token_budget

    def _reserve_slots(
        self, seq: Sequence, num_new: int, output: SchedulerOutput
    ) -> list[BlockCopy] | None:
        """Slots for `seq`, preempting from the tail of `running` until they fit."""
        while True:
            try:
                return self.kv.append_slots(seq, num_new)
            except OutOfBlocksError:
                if not self.kv.can_ever_fit(seq.num_computed_tokens + num_new):
                    self.running.remove(seq)
                    output.length_capped.append(seq)
                    return None
                victim = self.running[-1]
                self._preempt(victim, output)
                if victim is seq:
                    return None

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        self.num_recomputed_tokens += seq.num_computed_tokens
        self.kv.preempt(seq)
        output.preempted.append(seq)
        self.add(seq)
        seq.status = SequenceStatus.PREEMPTED

    def _schedule_waiting(self, token_budget: int, output: SchedulerOutput) -> None:
        while self.waiting and token_budget > 0:
            seq = self.waiting[0]
            num_seqs = seq.request.params.n if seq.request.needs_fork else 1
            if len(self.running) + num_seqs > self.config.max_num_seqs:
                return
            plan = self.kv.plan_admission(
                seq,
                token_budget,
                allow_partial=self.config.enable_chunked_prefill,
                keep_watermark=bool(self.running),
            )
            if plan is None:
                return
            self.waiting.pop(0)
            output.block_copies.extend(self.kv.admit(seq, plan))
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = plan.num_cached_tokens
            self.add_running(seq)
            output.chunks.append(ScheduledChunk.next_tokens(seq, plan.num_new_tokens))
            token_budget -= plan.num_new_tokens

    # ------------------------------------------------------------ after a step
    def mark_computed(self, output: SchedulerOutput) -> None:
        """Advance each scheduled sequence past the tokens the step computed."""
        for chunk in output.chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
            self.kv.mark_computed(chunk.seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` on shared copies of `parent`'s blocks (copy-on-write on first write)."""
        child.block_table = self.kv.fork(parent)
        child.num_computed_tokens = parent.num_computed_tokens
        self.add_running(child)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence wherever it is; its blocks return to the pool at once."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
