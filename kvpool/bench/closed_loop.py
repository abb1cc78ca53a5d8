"""Requests through one engine with a fixed number in flight (a closed loop, as a client with N
requests outstanding), and rounds of such runs over several engines in alternating order: the
measurement under `kvpool bench speculative`.

A run adds its first N requests, then, after each step, one more for each that finished, until
all have run: the batch holds N requests, like `max_num_seqs = N` with every request queued at
once, but on any engine whose `max_num_seqs` is at least N. Only the tail, once fewer than N
requests are left, runs below N, so a run reports two rates: over the whole run, and over its
steady part (from the start until the batch first holds fewer than N: the rate at N, with the
engine's count of tokens kept), and its mean requests in flight per step. Every run starts
clean (`reset_stats`: counters zeroed, prefix cache empty) and reports the spec-decode counts
of its own steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.speculative.stats import SpecDecodeStats


@dataclass(frozen=True, slots=True)
class Run:
    """One workload at one concurrency: its prompts (token ids), each greedy up to
    `max_tokens`."""

    workload: str
    concurrency: int
    prompts: list[list[int]]
    max_tokens: int
    ignore_eos: bool

    @property
    def label(self) -> str:
        return f"{self.workload}/{self.concurrency}"


def run_closed_loop(engine: LLMEngine, run: Run) -> dict:
    """`run`'s requests through `engine`, `run.concurrency` in flight, from a clean start: wall
    time and output tokens (those produced) of the whole run and of its steady part (until the
    batch first holds fewer than N with nothing left to add: the rate at N), steps, and the
    spec-decode counts of this run."""
    from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=run.max_tokens, ignore_eos=run.ignore_eos,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.reset_stats()
    before = engine.stats()
    waiting = deque(enumerate(run.prompts))
    in_flight: dict[str, int] = {}  # request id -> index in run.prompts
    token_ids: list[list[int]] = [[] for _ in run.prompts]
    steady: tuple[float, int] | None = None  # (seconds, tokens) at N in flight
    num_loop_steps = summed_in_flight = 0
    start = time.perf_counter()
    while waiting or in_flight:
        while waiting and len(in_flight) < run.concurrency:
            index, prompt = waiting.popleft()
            in_flight[engine.add_request({"prompt_token_ids": prompt}, params).request_id] = index
        if steady is None and len(in_flight) < run.concurrency:
            tokens = engine.stats().num_generated_tokens - before.num_generated_tokens
            steady = (time.perf_counter() - start, tokens)
        num_loop_steps += 1
        summed_in_flight += len(in_flight)
        for output in engine.step():
            if output.finished:
                token_ids[in_flight.pop(output.request_id)] = list(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    num_output = sum(len(tokens) for tokens in token_ids)
    steady_s, steady_tokens = steady or (elapsed, num_output)  # one in flight: the whole run
    return {
        "elapsed_s": elapsed,
        "num_output_tokens": num_output,
        "output_tokens_per_s": num_output / elapsed,
        "steady_s": steady_s,
        "num_steady_tokens": steady_tokens,
        "steady_output_tokens_per_s": steady_tokens / steady_s,
        "mean_in_flight": summed_in_flight / num_loop_steps,
        "num_steps": stats.num_steps,
        "num_preemptions": stats.num_preemptions,
        "spec_decode": _spec_counts(stats.spec_decode, before.spec_decode),
        "token_ids": token_ids,
    }


def _spec_counts(after: SpecDecodeStats, before: SpecDecodeStats) -> dict:
    """The spec-decode counts between two `SpecDecodeStats` (`before` is zero when
    `reset_stats` clears them; the difference holds either way)."""
    per_pos = list(after.num_accepted_tokens_per_pos)
    for position, count in enumerate(before.num_accepted_tokens_per_pos):
        per_pos[position] -= count
    return {"num_drafts": after.num_drafts - before.num_drafts,
            "num_draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
            "num_accepted_tokens": after.num_accepted_tokens - before.num_accepted_tokens,
            "num_accepted_tokens_per_pos": per_pos}


def run_rounds(engines: dict[str, LLMEngine], run: Run, num_rounds: int) -> dict[str, list]:
    """Each engine's runs of `run`, one per round; the order reverses every other round, so a
    drift of the machine's speed lands on every engine alike."""
    labels = list(engines)
    results: dict[str, list] = {label: [] for label in labels}
    for round_index in range(num_rounds):
        for label in labels if round_index % 2 == 0 else labels[::-1]:
            results[label].append(run_closed_loop(engines[label], run))
    return results
