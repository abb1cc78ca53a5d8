"""The scheduler on a tiny pool, without a model: who runs, how much, who gets preempted."""

from __future__ import annotations

import itertools

import pytest

from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.sampling.sampler import SamplerOutput
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler import Scheduler, SchedulerConfig
from kvpool.engine.sequence import FinishReason, Request, Sequence, SequenceStatus
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.prefix_cache import NO_SALT, hash_full_blocks

BLOCK_SIZE = 4
_ids = itertools.count()


class NeverStop:
    def on_token(self, seq, token_id, logprobs):
        return None


def make_scheduler(num_blocks=8, watermark_blocks=0, **options) -> Scheduler:
    memory = KVMemory(KVLayout(BLOCK_SIZE), num_blocks, watermark=watermark_blocks / num_blocks)
    assert memory.watermark_blocks == watermark_blocks
    return Scheduler(SchedulerConfig(**options), KVCacheManager(memory), NeverStop())


def add(
    scheduler: Scheduler, num_prompt_tokens: int, priority=0, arrival=None, first=0,
    params=None,
) -> Sequence:
    request_id = next(_ids)
    prompt = list(range(first, first + num_prompt_tokens))
    params = params or SamplingParams()
    request = Request(str(request_id), None, prompt, params, arrival or request_id, NO_SALT,
                      (None,) * params.n, priority)
    return scheduler.add_request(request, hash_full_blocks(prompt, BLOCK_SIZE))


def run_step(scheduler: Scheduler, next_token: int = 7):
    """schedule → pretend the model and sampler ran (every row samples `next_token`) →
    update."""
    output = scheduler.schedule()
    num_rows = sum(chunk.num_samples for chunk in output.chunks)
    scheduler.update(output, SamplerOutput([next_token] * num_rows, [None] * num_rows))
    return output


def test_prefill_then_one_token_decodes():
    scheduler = make_scheduler()
    seq = add(scheduler, 6)
    first = run_step(scheduler)
    assert [(c.num_computed_tokens, c.num_new_tokens) for c in first.chunks] == [(0, 6)]
    second = run_step(scheduler)
    assert [(c.num_computed_tokens, c.num_new_tokens) for c in second.chunks] == [(6, 1)]
    assert seq.block_table.num_tokens == seq.num_computed_tokens == 7


def test_chunked_prefill_splits_long_prompts_and_decodes_keep_flowing():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=5)
    short = add(scheduler, 2)
    run_step(scheduler)  # short prefilled (2 tokens)
    long = add(scheduler, 9)
    step = run_step(scheduler)
    assert [(c.seq, c.num_new_tokens) for c in step.chunks] == [(short, 1), (long, 4)]
    assert not step.chunks[1].completes_sequence
    step = run_step(scheduler)
    assert [(c.seq, c.num_new_tokens) for c in step.chunks] == [(short, 1), (long, 4)]
    step = run_step(scheduler)
    assert [(c.seq, c.num_new_tokens) for c in step.chunks] == [(short, 1), (long, 1)]
    assert step.chunks[1].completes_sequence and long.output_token_ids == [7]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    scheduler = make_scheduler(
        num_blocks=16, max_num_batched_tokens=6, enable_chunked_prefill=False
    )
    add(scheduler, 2)
    blocked = add(scheduler, 6)
    step = run_step(scheduler)
    assert [c.seq for c in step.chunks] != [] and blocked.status is SequenceStatus.WAITING
    step = run_step(scheduler)
    assert blocked.status is SequenceStatus.WAITING  # 1 decode token + 6 > 6
    assert len(step.chunks) == 1


def test_admission_is_fcfs_and_respects_max_num_seqs():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2)
    a = add(scheduler, 4)
    b = add(scheduler, 9)  # needs 3 blocks: only 3 left after a, fits
    c = add(scheduler, 1)
    run_step(scheduler)
    assert [s.status for s in (a, b, c)] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING]


def test_a_big_waiting_request_blocks_later_small_ones():
    scheduler = make_scheduler(num_blocks=4)
    add(scheduler, 12)  # 3 blocks
    big = add(scheduler, 8)  # 2 blocks: does not fit next to the first
    small = add(scheduler, 1)
    run_step(scheduler)
    assert big.status is SequenceStatus.WAITING and small.status is SequenceStatus.WAITING


def test_watermark_is_kept_only_while_others_run():
    scheduler = make_scheduler(num_blocks=4, watermark_blocks=1)
    first = add(scheduler, 16)  # all 4 blocks: allowed, nothing else runs
    run_step(scheduler)
    assert first.status is SequenceStatus.RUNNING
    scheduler.finish(first, FinishReason.STOP)
    a = add(scheduler, 8, first=100)
    b = add(scheduler, 8, first=200)  # a holds 2; b would leave 0 < watermark 1
    run_step(scheduler)
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING


def test_preemption_picks_the_latest_arrival_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=3)
    old = add(scheduler, 4)
    young = add(scheduler, 4)
    later = add(scheduler, 1)
    run_step(scheduler)  # old, young: 1 full block each; later: 1 block
    assert scheduler.kv.pool.num_allocatable_blocks == 0
    step = run_step(scheduler)
    # old needs a block for its 5th token: the latest arrival goes. Then young needs one, and
    # is itself now the latest running: it preempts itself rather than an older sequence.
    assert step.preempted == [later, young]
    assert [c.seq for c in step.chunks] == [old]
    assert later.status is SequenceStatus.WAITING and later.num_computed_tokens == 0
    assert list(scheduler.waiting) == [young, later] and scheduler.num_preemptions == 2
    assert scheduler.num_recomputed_tokens == 4 + 1


def test_priority_beats_arrival_when_choosing_a_victim():
    scheduler = make_scheduler(num_blocks=2)
    important_late = add(scheduler, 4, priority=0, arrival=10)
    unimportant_early = add(scheduler, 4, priority=5, arrival=1)
    run_step(scheduler)
    step = run_step(scheduler)
    assert step.preempted == [unimportant_early]
    assert important_late.status is SequenceStatus.RUNNING


def test_finish_frees_blocks_and_removes_the_sequence():
    scheduler = make_scheduler()
    seq = add(scheduler, 6)
    run_step(scheduler)
    scheduler.finish(seq, FinishReason.ABORT)
    assert not scheduler.has_unfinished()
    assert scheduler.kv.pool.num_used_blocks == 0
    assert seq.finish_reason is FinishReason.ABORT


def test_prefix_hit_is_reported_and_not_recomputed():
    scheduler = make_scheduler(num_blocks=8)
    first = add(scheduler, 9, first=100)
    run_step(scheduler)
    scheduler.finish(first, FinishReason.STOP)
    again = add(scheduler, 9, first=100)
    step = run_step(scheduler)
    assert again.request.num_cached_tokens == 8
    assert [(c.num_computed_tokens, c.num_new_tokens) for c in step.chunks] == [(8, 1)]


def test_a_request_to_fork_takes_its_n_seats_at_admission():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=4)
    forked = add(scheduler, 2, params=SamplingParams(n=3))
    single = add(scheduler, 2)
    late = add(scheduler, 2)
    run_step(scheduler)  # the n=3 prompt completes and forks: 3 seats, then 1 more
    assert late.status is SequenceStatus.WAITING
    assert len(scheduler.running) == 4 == len(forked.request.sequences) + 1
    assert single.status is SequenceStatus.RUNNING
    for _ in range(3):
        run_step(scheduler)
        assert len(scheduler.running) <= 4


def test_roll_back_requeues_a_failed_step_without_its_reservations():
    scheduler = make_scheduler(num_blocks=8)
    decoding = add(scheduler, 5)
    run_step(scheduler)
    fresh = add(scheduler, 6, first=50)
    batch = scheduler.schedule()
    assert [chunk.seq for chunk in batch.chunks] == [decoding, fresh]
    scheduler.roll_back(batch)  # the model raised: nothing of this step happened
    scheduler.check_invariants([decoding, fresh])
    assert list(scheduler.waiting) == [decoding, fresh]
    assert scheduler.kv.pool.num_used_blocks == 0
    run_step(scheduler)  # both recompute from their cached full blocks at most
    scheduler.check_invariants([decoding, fresh])
    assert decoding.output_token_ids == [7, 7] and fresh.output_token_ids == [7]


def test_aborting_waiting_sequences_is_lazy_and_keeps_counts():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=1)
    running = add(scheduler, 2)
    run_step(scheduler)
    waiting = [add(scheduler, 2, first=10 + i) for i in range(1000)]
    assert scheduler.request_counts() == (1, 1000)
    for seq in waiting[:-1]:
        scheduler.finish(seq, FinishReason.ABORT)
    assert len(scheduler.waiting) == 1 and scheduler.request_counts() == (1, 1)
    scheduler.finish(running, FinishReason.STOP)
    run_step(scheduler)
    assert waiting[-1].status is SequenceStatus.RUNNING and len(scheduler.waiting) == 0
    assert scheduler.request_counts() == (1, 0)


class _CountingHashlib:
    def __init__(self, hashlib) -> None:
        self.hashlib = hashlib
        self.num_sha256 = 0

    def sha256(self, *args):
        self.num_sha256 += 1
        return self.hashlib.sha256(*args)


def test_a_prompt_is_hashed_once_however_long_it_waits(monkeypatch):
    from kvpool.memory import prefix_cache

    counting = _CountingHashlib(prefix_cache.hashlib)
    monkeypatch.setattr(prefix_cache, "hashlib", counting)
    scheduler = make_scheduler(num_blocks=5)
    hog = add(scheduler, 15)  # 4 blocks, then 5: the blocked prompt's 3 never fit beside it
    run_step(scheduler)  # its 3 full prompt blocks, and the 4th its first output fills
    assert counting.num_sha256 == 3 + 1
    blocked = add(scheduler, 9, first=100)  # 2 full blocks
    assert counting.num_sha256 == 4 + 2
    for _ in range(3):
        run_step(scheduler)  # planned (and refused) at the head of the queue every step
        assert blocked.status is SequenceStatus.WAITING
    assert counting.num_sha256 == 6
    scheduler.finish(hog, FinishReason.STOP)
    run_step(scheduler)  # admitted, computed, published: with the hashes it already had
    assert blocked.status is SequenceStatus.RUNNING and counting.num_sha256 == 6
    assert blocked.block_table.num_published_blocks == 2


@pytest.mark.parametrize("chunked", [True, False])
def test_the_planned_prefix_match_is_the_one_admission_takes(chunked):
    scheduler = make_scheduler(num_blocks=8, enable_chunked_prefill=chunked,
                               max_num_batched_tokens=64)
    first = add(scheduler, 9, first=300)
    run_step(scheduler)
    first_blocks = list(first.block_table.block_ids)
    scheduler.finish(first, FinishReason.STOP)
    again = add(scheduler, 13, first=300)
    plan = scheduler.kv.plan_admission(again, 64, allow_partial=chunked, keep_watermark=False)
    assert plan is not None and plan.prefix.block_ids == first_blocks[:2]
    assert plan.num_cached_tokens == 8 and plan.prefix.num_evictable == 2
    run_step(scheduler)
    assert again.block_table.block_ids[:2] == first_blocks[:2]


PROMPT_LOGPROBS = SamplingParams(prompt_logprobs=2)


def test_prompt_logprob_positions_follow_the_chunks_and_stop_before_the_last_token():
    # Entry i comes from position i - 1: a 10-token prompt needs positions 0..8 (position 9
    # samples the first output). Each chunk asks for its own positions, so the entry of a
    # later chunk's first token (4, 8) comes from the previous chunk's last position.
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    seq = add(scheduler, 10, params=PROMPT_LOGPROBS)
    steps = [run_step(scheduler).chunks[0] for _ in range(4)]
    assert [(c.num_computed_tokens, c.num_new_tokens, c.num_samples) for c in steps] == [
        (0, 4, 0), (4, 4, 0), (8, 2, 1), (10, 1, 1)]
    assert [c.prompt_logprob_positions for c in steps] == [
        range(0, 4), range(4, 8), range(8, 9), range(10, 10)]
    assert seq.request.num_prompt_logprob_positions == 9
    plain = add(scheduler, 3, first=40)
    assert run_step(scheduler).chunks[1].seq is plain
    assert all(not chunk.prompt_logprob_positions for chunk in run_step(scheduler).chunks)


def test_prompt_logprobs_take_no_cached_prefix_and_a_requeue_reuses_only_what_is_done():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    first = add(scheduler, 13, first=200)
    while not first.output_token_ids:
        run_step(scheduler)
    scheduler.finish(first, FinishReason.STOP)  # its 3 full blocks stay in the prefix cache
    again = add(scheduler, 13, first=200, params=PROMPT_LOGPROBS)
    step = run_step(scheduler)
    assert again.request.num_cached_tokens == 0
    assert [(c.num_computed_tokens, c.prompt_logprob_positions) for c in step.chunks] == [
        (0, range(0, 8))]
    batch = scheduler.schedule()  # positions 8..11: the step fails, nothing of it happened
    scheduler.roll_back(batch)
    step = run_step(scheduler)  # back from the cache: the 2 blocks whose positions are done
    assert [(c.num_computed_tokens, c.prompt_logprob_positions) for c in step.chunks] == [
        (8, range(8, 12))]
    assert again.request.num_prompt_logprob_positions == 12 and again.output_token_ids == [7]
