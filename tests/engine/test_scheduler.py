"""The scheduler on a tiny pool, without a model: who runs, how much, who gets preempted."""

from __future__ import annotations

import itertools

from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler import Scheduler, SchedulerConfig
from kvpool.engine.sequence import FinishReason, Request, Sequence, SequenceStatus
from kvpool.memory.block_pool import BlockPool

BLOCK_SIZE = 4
_ids = itertools.count()


def make_scheduler(num_blocks=8, watermark_blocks=0, **options) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, BLOCK_SIZE), watermark_blocks)
    return Scheduler(SchedulerConfig(**options), kv)


def add(
    scheduler: Scheduler, num_prompt_tokens: int, priority=0, arrival=None, first=0
) -> Sequence:
    seq_id = next(_ids)
    prompt = list(range(first, first + num_prompt_tokens))
    request = Request(str(seq_id), None, prompt, SamplingParams(), arrival or seq_id, priority)
    seq = Sequence(seq_id, request, 0, scheduler.kv.new_block_table(None))
    request.sequences.append(seq)
    scheduler.add(seq)
    return seq


def run_step(scheduler: Scheduler, next_token: int = 7):
    """schedule → pretend the model ran → append a token to every completed sequence."""
    output = scheduler.schedule()
    scheduler.mark_computed(output)
    for chunk in output.chunks:
        if chunk.completes_sequence:
            chunk.seq.output_token_ids.append(next_token)
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
    assert later.status is SequenceStatus.PREEMPTED and later.num_computed_tokens == 0
    assert scheduler.waiting == [young, later] and scheduler.num_preemptions == 2
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
