"""Continuous batching: every step, pick which tokens of which sequences to compute; after the
step, bring every sequence up to date.

One step's batch, formed by `schedule()`:

1. Running sequences, in priority order: each gets its remaining tokens (one for a decode, a
   chunk for an unfinished prefill) while the token budget lasts. When the pool has no block
   for one of them, the lowest-priority, latest-arriving running sequence is preempted until
   the block fits, possibly the sequence itself; its KV is dropped for recomputation or
   swapped to the host tier (`KVCacheManager.preempt` decides), and it waits again. A
   sequence preempted twice within `HYSTERESIS_STEPS` steps is passed over as a victim while
   another candidate is left (a thrashing guard).
2. Waiting sequences, in priority order, while the budget, `max_num_seqs` and memory allow:
   admitted with their prefix-cache hit and a first chunk (or their whole prompt when chunked
   prefill is off). Admission stops at the first that does not fit (no overtaking), and no one
   is admitted in a step that had to preempt. A request with n > 1 takes n seats at admission:
   its other n - 1 sequences are forked from it once its prompt is computed.

3. Drafts (speculative decoding), last and with what is left: the speculator
   (`kvpool.engine.speculative`) guesses the next tokens of decode chunks,
   sized to what pays; each guess gets tentative slots from free blocks (never by preempting,
   growing or evicting), else it is dropped.

Each chunk also names the positions whose logits the step must return for prompt logprobs
(`kvpool.engine.requests.prompt_logprobs.chunk_positions`: the request's pending ones among
the chunk's).

After the model ran and the sampler chose tokens, `update()` does the rest of the step:
mark what was computed (prompt logprob positions too), fork the n - 1 siblings of each prompt
that just completed (all n sample their first token from the same logits), append every sampled
token, ask the stop rules (`StopChecker`, the output processor) whether each sequence is done,
and free the finished. A chunk with drafts keeps the drafts the sampler agreed with and the
sampler's token after them, one at a time through the stop rules (nothing past a stop is
kept); its table commits their slots and drops the rest before anything is published.
A beam search's rows wait for the round: once every live beam of the request has one, the
best continuations are kept (`kvpool.engine.beams`), forking parents and freeing pruned ones
at once. A running beam with nothing left to compute waits for that round and is passed
over; if a step would run nothing while sequences wait for room, such beams give their KV up
and sleep (`sleeping`, in neither queue) until their round queues them again.
A step that failed before its update is undone by `roll_back()`: its sequences are requeued
with their KV dropped, so no slot reserved for a step that never ran survives.

Invariants (`check_invariants`): `running` is sorted by `Sequence.sort_key`; a sequence is
running, waiting or finished, and in at most one of the two queues; between steps every running
sequence's block table holds exactly its computed tokens, and every waiting one holds no device
block and has no computed token, unless it is swapped out (its computed tokens then sit in host
blocks it owns); a waiting sequence is in the waiting queue or sleeping, never both.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvpool.engine.beams.group import Child
from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.preemption import HYSTERESIS_STEPS, RECOMPUTE
from kvpool.engine.requests.outputs import Logprob
from kvpool.engine.requests.prompt_logprobs import chunk_positions
from kvpool.engine.sampling.sampler import SamplerOutput
from kvpool.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from kvpool.engine.sequence import FinishReason, Request, Sequence, SequenceStatus
from kvpool.engine.speculative import NoSpeculation, accepted_length
from kvpool.engine.waiting_queue import WaitingQueue
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.errors import OutOfBlocksError

StopDecision = tuple[FinishReason, str | int | None]


class StopChecker(Protocol):
    def on_token(
        self, seq: Sequence, token_id: int, logprobs: dict[int, Logprob] | None
    ) -> StopDecision | None:
        """Record a token the sequence just got; say why it stops now, or None."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 stop_checker: StopChecker, speculator: NoSpeculation | None = None) -> None:
        self.config = config
        self.kv = kv
        self.stop_checker = stop_checker
        self.speculator = speculator or NoSpeculation()
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.sleeping: set[Sequence] = set()  # beams whose KV went while they awaited a round
        self.reset_counters()
        self._seq_ids = itertools.count()
        self._num_schedules = 0
        self._preempted_at: dict[int, tuple[int, ...]] = {}  # seq_id -> its last two steps

    def reset_counters(self) -> None:
        """Zero the preemption counters, the KV manager's with them."""
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens dropped by preemption
        self.num_output_tokens = 0  # tokens sequences kept (sampled, or drafted and verified)
        self.kv.reset_counters()
        self.speculator.reset_counters()

    def add_request(self, request: Request, block_hashes: list) -> Sequence:
        """Queue the first sequence of a new request; `block_hashes` are its prompt's."""
        seq = self._new_sequence(request, 0, self.kv.new_block_table(),
                                 block_hashes)
        self.waiting.push(seq)
        return seq

    def _new_sequence(self, request: Request, index: int, block_table, block_hashes) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, block_table, block_hashes)
        request.sequences.append(seq)
        return seq

    def _add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def _requeue(self, seq: Sequence) -> None:
        """Out of `running` (its KV already dropped or swapped out), waiting again."""
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def request_counts(self) -> tuple[int, int]:
        """(requests with a running sequence, requests with a waiting one), cheaply."""
        return len({seq.request.request_id for seq in self.running}), self.waiting.num_requests

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        self._num_schedules += 1
        output = SchedulerOutput()
        token_budget = self._schedule_running(self.config.max_num_batched_tokens, output)
        if not output.preempted:
            token_budget = self._schedule_waiting(token_budget, output)
            token_budget = self._make_room_for_waiting_beams(token_budget, output)
        self._add_drafts(token_budget, output)
        return output

    def _add_drafts(self, token_budget: int, output: SchedulerOutput) -> None:
        """The speculator's drafts, in tentative slots, where free blocks hold them."""
        chunks = output.chunks
        for index, drafts in self.speculator.propose(chunks, token_budget,
                                                     len(self.running)).items():
            copies = self.kv.append_drafts(chunks[index].seq, len(drafts))
            if copies is not None:
                output.block_copies.extend(copies)
                chunks[index] = chunks[index].with_drafts(drafts)

    def _schedule_running(self, token_budget: int, output: SchedulerOutput) -> int:
        index = 0
        while (
            index < len(self.running)
            and token_budget > 0
            and len(output.chunks) < self.config.max_num_seqs
        ):
            seq = self.running[index]
            if not seq.num_uncomputed_tokens:  # a beam waiting for its round's other beams
                index += 1
                continue
            start = seq.num_computed_tokens
            token_ids = seq.token_ids(start, start + min(seq.num_uncomputed_tokens, token_budget))
            copies = self._reserve_slots(seq, token_ids, output)
            if copies is None:  # the sequence itself was preempted or capped
                continue
            output.block_copies.extend(copies)
            output.chunks.append(self._chunk(seq, token_ids))
            token_budget -= len(token_ids)
            index += 1
        return token_budget

    def _make_room_for_waiting_beams(self, token_budget: int, output: SchedulerOutput) -> int:
        """A step with nothing to run while beams wait for their round and their siblings
        wait for room: the waiting beams give their KV up (lowest priority first; each keeps
        its row, so it is computed again only if re-admitted before the round) until a
        waiting sequence is admitted. Without this, parked beams could hold the pool forever."""
        while not output.chunks and len(self.waiting) > 0:
            parked = [seq for seq in self.running if not seq.num_uncomputed_tokens]
            if not parked:
                break
            # Asleep, outside both queues: not re-admitted to compute the row it has; its
            # round queues it again with its new token. (Dropped, never swapped: a sequence
            # with nothing left to compute is not.)
            self._preempt(parked[-1], output, asleep=True)
            token_budget = self._schedule_waiting(token_budget, output)
        return token_budget

    def _chunk(self, seq: Sequence, token_ids: list[int]) -> ScheduledChunk:
        start = seq.num_computed_tokens
        end = start + len(token_ids)
        num_samples = 0
        if end == seq.num_tokens:
            num_samples = seq.request.params.n if seq.request.needs_fork else 1
        return ScheduledChunk(seq, start, token_ids, num_samples,
                              chunk_positions(seq.request, start, end))

    def _reserve_slots(
        self, seq: Sequence, token_ids: list[int], output: SchedulerOutput
    ) -> list[BlockCopy] | None:
        """Slots for `seq`, preempting from the tail of `running` until they fit."""
        while True:
            try:
                return self.kv.append_slots(seq, len(token_ids))
            except OutOfBlocksError:
                if not self.kv.can_ever_fit(seq.num_computed_tokens + len(token_ids)):
                    self.finish(seq, FinishReason.LENGTH)
                    output.length_capped.append(seq)
                    return None
                victim = self._pick_victim(seq)
                self._preempt(victim, output)
                if victim is seq:
                    return None

    def _pick_victim(self, seq: Sequence) -> Sequence:
        """The lowest-priority running sequence from `seq` on (those before it are already
        in the batch), passing over any preempted twice within `HYSTERESIS_STEPS` steps
        while another is left."""
        candidates = self.running[self.running.index(seq):]
        for victim in reversed(candidates):
            if not self.recently_preempted(victim):
                return victim
        return candidates[-1]

    def recently_preempted(self, seq: Sequence) -> bool:
        """Preempted twice within the last `HYSTERESIS_STEPS` steps (the thrashing guard)."""
        steps = self._preempted_at.get(seq.seq_id, ())
        return len(steps) == 2 and self._num_schedules - steps[0] < HYSTERESIS_STEPS

    def _preempt(self, seq: Sequence, output: SchedulerOutput, asleep: bool = False) -> None:
        """Take `seq`'s KV off the device; it waits again, or (a beam awaiting its round)
        sleeps."""
        self.num_preemptions += 1
        num_computed = seq.num_computed_tokens
        if self.kv.preempt(seq) == RECOMPUTE:
            self.num_recomputed_tokens += num_computed
        steps = self._preempted_at.get(seq.seq_id, ())
        self._preempted_at[seq.seq_id] = (*steps[-1:], self._num_schedules)
        if asleep:
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
            self.sleeping.add(seq)
        else:
            self._requeue(seq)
        output.preempted.append(seq)

    def _schedule_waiting(self, token_budget: int, output: SchedulerOutput) -> int:
        """Admit waiting sequences; returns the token budget left."""
        # Seats: a request that has yet to fork counts its n sequences from admission on.
        num_seats = sum(_num_seats(seq) for seq in self.running)
        while token_budget > 0 and (seq := self.waiting.peek()) is not None:
            if num_seats + _num_seats(seq) > self.config.max_num_seqs:
                break
            plan = self.kv.plan_admission(
                seq,
                token_budget,
                allow_partial=self.config.enable_chunked_prefill,
                keep_watermark=bool(self.running),
            )
            if plan is None:
                break
            self.waiting.pop()
            output.block_copies.extend(self.kv.admit(seq, plan))
            if seq.request.num_cached_tokens is None:  # its first admission
                seq.request.num_cached_tokens = plan.num_cached_tokens
                seq.request.first_scheduled_time = time.monotonic()
            num_seats += _num_seats(seq)
            self._add_running(seq)
            start = seq.num_computed_tokens
            token_ids = seq.token_ids(start, start + plan.num_new_tokens)
            output.chunks.append(self._chunk(seq, token_ids))
            token_budget -= plan.num_new_tokens
        return token_budget

    # ------------------------------------------------------------ after a step
    def update(self, batch: SchedulerOutput, sampled: SamplerOutput) -> list[Request]:
        """Bring every scheduled sequence up to date after the model and the sampler ran;
        returns the requests whose outputs changed, in batch order."""
        for chunk in batch.chunks:
            if chunk.draft_token_ids:
                continue  # computed once the verification knows how many drafts hold
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
            self.kv.mark_computed(chunk.seq)
            if chunk.prompt_logprob_positions:
                chunk.seq.request.num_prompt_logprob_positions = chunk.prompt_logprob_positions.stop
        touched = {seq.request.request_id: seq.request for seq in batch.length_capped}
        rows = iter(zip(sampled.token_ids, sampled.logprobs, strict=True))
        for chunk in batch.chunks:
            if chunk.draft_token_ids:
                self._verify(chunk, [next(rows) for _ in range(chunk.num_sampling_rows)])
            elif chunk.num_samples:
                for seq in self._fork_siblings(chunk):
                    self._take_row(seq, *next(rows))
            if chunk.num_samples:
                touched[chunk.seq.request.request_id] = chunk.seq.request
        assert next(rows, None) is None, "more sampled rows than sequences"
        for request in touched.values():
            if request.beams is not None:
                self._run_beam_round(request)
        return list(touched.values())

    def _take_row(self, seq: Sequence, token_id: int,
                  logprobs: dict[int, Logprob] | None) -> None:
        """A sampled row: its token joins `seq`, or, for a beam, the row waits for the
        round (`_run_beam_round`)."""
        if seq.request.beams is None:
            self._append(seq, token_id, logprobs)
        else:
            assert logprobs is not None, "a beam's row carries its candidates"
            seq.request.beams.offer(seq, logprobs)

    def _verify(self, chunk: ScheduledChunk,
                rows: list[tuple[int, dict[int, Logprob] | None]]) -> None:
        """Keep the drafts the sampler agreed with and its token after them: their slots are
        committed (the others dropped), then the tokens join the sequence one by one through
        the stop rules, and the full blocks are published."""
        seq, drafts = chunk.seq, chunk.draft_token_ids
        num_accepted = accepted_length(drafts, [token_id for token_id, _ in rows])
        self.speculator.verified(seq, len(drafts), num_accepted)
        seq.num_computed_tokens += chunk.num_new_tokens - len(drafts) + num_accepted
        self.kv.commit_drafts(seq, num_accepted)
        for token_id, logprobs in rows[: num_accepted + 1]:
            self._append(seq, token_id, logprobs)
            if seq.is_finished:
                return
        self.kv.mark_computed(seq)

    def _fork_siblings(self, chunk: ScheduledChunk) -> list[Sequence]:
        """The chunk's sequence, then (where its prompt just completed) its new siblings,
        sharing every block until one writes (copy-on-write)."""
        parent = chunk.seq
        family = [parent]
        while parent.request.needs_fork and len(family) < chunk.num_samples:
            family.append(self._fork(parent))
        return family

    def _fork(self, parent: Sequence) -> Sequence:
        """A sibling of `parent` with its tokens: running and sharing all its blocks, or,
        for a beam whose KV was dropped while it waited for its round, waiting with none."""
        request = parent.request
        child = self._new_sequence(request, len(request.sequences), self.kv.fork(parent),
                                   list(parent.block_hashes))
        child.num_computed_tokens = parent.num_computed_tokens
        child.output_token_ids = list(parent.output_token_ids)
        if parent.status is SequenceStatus.RUNNING:
            self._add_running(child)
        else:
            child.status = SequenceStatus.WAITING
            self.waiting.push(child)
        return child

    def _run_beam_round(self, request: Request) -> None:
        """Once every live beam has its row: keep the best continuations (`BeamGroup.expand`),
        forking a parent for each kept child beyond its first and freeing a parent with none
        (pruned, or ended in EOS) at once."""
        beams = request.beams
        live = [seq for seq in request.sequences if not seq.is_finished]
        if not live or not beams.is_ready(live):
            return
        for parent, children in beams.expand(live).items():
            if not children:
                self.finish(parent, FinishReason.STOP)
                continue
            for child in children[1:]:  # forks first: they share the parent's tokens so far
                self._continue_beam(self._fork(parent), child)
            self._continue_beam(parent, children[0])

    def _continue_beam(self, seq: Sequence, child: Child) -> None:
        self.kv.append_output(seq, child.token_id)
        self.num_output_tokens += 1
        # Its length ran out, or (asleep, growing with no room check) it outgrew the pool.
        if (not seq.request.beams.continue_as(seq, child.beam)
                or not self.kv.can_ever_fit(seq.num_tokens)):
            self.finish(seq, FinishReason.LENGTH)
        elif seq in self.sleeping:  # its KV went while it waited: computed again from here
            self.sleeping.remove(seq)
            self.waiting.push(seq)

    def _append(self, seq: Sequence, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        self.kv.append_output(seq, token_id)
        self.num_output_tokens += 1
        decision = self.stop_checker.on_token(seq, token_id, logprobs)
        if decision is not None:
            self.finish(seq, *decision)

    def roll_back(self, batch: SchedulerOutput) -> None:
        """Undo a step that failed before `update`: every scheduled sequence still running is
        requeued with its KV dropped (its reserved slots never received KV); then the
        listeners hear it (`step_rolled_back`: the tiers write nothing the step published)."""
        for chunk in batch.chunks:
            if chunk.seq.status is SequenceStatus.RUNNING:
                self.kv.drop(chunk.seq)
                self._requeue(chunk.seq)
        self.kv.listeners.step_rolled_back()

    def finish(self, seq: Sequence, reason: FinishReason,
               stop_reason: str | int | None = None) -> None:
        """Retire a sequence wherever it is; its blocks return to the pool at once."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.discard(seq)
            self.sleeping.discard(seq)
        self.kv.free(seq)
        if seq.request.beams is not None:  # a live beam ended outside its round: kept as is
            seq.request.beams.end(seq, str(reason))
        self.speculator.forget(seq)
        self._preempted_at.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def check_invariants(self, sequences: Iterable[Sequence]) -> None:
        """Assert the module docstring's invariants for `sequences` (every unfinished one)."""
        assert [s.sort_key for s in self.running] == sorted(s.sort_key for s in self.running)
        for seq in sequences:
            table = seq.block_table
            is_running, is_waiting = seq in self.running, seq in self.waiting
            assert not (is_running and is_waiting), f"sequence {seq.seq_id} is in both queues"
            if seq.is_finished:
                assert not (is_running or is_waiting) and table.num_blocks == 0
            elif is_running:
                assert seq.status is SequenceStatus.RUNNING
                assert table.num_tokens == seq.num_computed_tokens
                assert table.num_tentative == 0, "a draft outlived its step"
            else:
                assert seq.status is SequenceStatus.WAITING
                assert is_waiting != (seq in self.sleeping), f"sequence {seq.seq_id} is lost"
                assert table.num_blocks == 0
                assert seq.num_computed_tokens == 0 or self.kv.is_swapped(seq)
            if seq.request.beams is not None:
                seq.request.beams.check_invariants()


def _num_seats(seq: Sequence) -> int:
    return seq.request.num_seats(seq)
