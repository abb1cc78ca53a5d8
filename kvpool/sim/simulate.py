"""The simulator's step loop: replay a trace through one strategy, without running a model.

One step, the same for every strategy:

    1. arrivals      requests whose arrival <= step join the waiting queue (FCFS)
    2. admission     while the queue head fits, it is admitted: its prefill stores the prompt
                     (plus tokens it generated before a preemption) for each of its samples
    3. decode        every request admitted in an earlier step stores one more token per
                     sample, oldest first; when memory runs out the youngest running request is
                     preempted (freed, back to the queue front; it keeps its generated tokens
                     and recomputes them on re-admission, as vLLM's recompute does)
    4. measure       concurrency and where the memory is (`MemorySnapshot`)
    5. finish        requests that have generated all their tokens free their memory

A request with output length O is admitted at step a and finishes at step a + O, holding
prompt + O tokens at the end. Memory fractions are averaged over the *memory-bound* steps
(a request was left waiting for memory), where how well memory is used decides how many
sequences run; over all steps if no step was memory-bound (`token_state_fraction_all_steps`
always covers every step). Concurrency is averaged over all steps. Strategies whose arena
caches or compacts add what it did over the run (`ArenaActivity`: cache hits, compactions,
bytes moved); the others report zeros.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpool.sim.strategies import ArenaActivity, ReportsArenaActivity, SimConfig, Strategy
from kvpool.sim.trace import Request


@dataclass(slots=True)
class _Running:
    request: Request
    num_generated: int = 0
    admitted_step: int = -1


@dataclass(frozen=True, slots=True)
class SimResult:
    """One strategy's outcome on one trace; fractions are of the budget."""

    strategy: str
    block_size: int | None
    steps: int  # makespan proxy: steps until the last request finished
    num_preemptions: int
    peak_concurrency: int  # running sequences
    mean_concurrency: float
    token_state_fraction: float
    reservation_fraction: float
    internal_fragmentation: float
    free_fraction: float
    external_fragmentation: float  # mean of 1 - largest free range / free
    num_memory_bound_steps: int
    token_state_fraction_all_steps: float  # the same, averaged over every step
    concurrency: list[int] = field(repr=False)  # per step
    num_cache_hits: int = 0  # size-class cache hits (contiguous-classes)
    num_compactions: int = 0  # arena compactions (contiguous-exact-compact)
    num_bytes_moved: int = 0  # KV bytes those compactions copied

    def to_json(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__ if name != "concurrency"}


@dataclass(slots=True)
class _Meter:
    """Per-step concurrency, and running sums of (1, token_states, reservation, internal, free,
    external_fragmentation) over all steps and over the memory-bound ones."""

    concurrency: list[int] = field(default_factory=list)
    all_sums: list[float] = field(default_factory=lambda: [0.0] * 6)
    bound_sums: list[float] = field(default_factory=lambda: [0.0] * 6)

    def record(self, strategy: Strategy, num_sequences: int, is_memory_bound: bool) -> None:
        self.concurrency.append(num_sequences)
        snapshot = strategy.memory()
        values = (1.0, snapshot.token_states, snapshot.reservation, snapshot.internal,
                  snapshot.free, snapshot.external_fragmentation)
        for sums in (self.all_sums, self.bound_sums) if is_memory_bound else (self.all_sums,):
            for index, value in enumerate(values):
                sums[index] += value


def simulate(trace: Iterable[Request], strategy: Strategy, config: SimConfig) -> SimResult:
    """Run `trace` to completion under `strategy` (see the module docstring for one step)."""
    pending = deque(sorted(trace, key=lambda request: (request.arrival, request.request_id)))
    if not pending:
        raise ValueError("the trace has no requests")
    for request in pending:
        if request.final_len > config.max_seq_len:
            raise ValueError(f"request {request.request_id} needs {request.final_len} tokens, "
                             f"more than max_seq_len {config.max_seq_len}")
    waiting: deque[_Running] = deque()
    running: list[_Running] = []
    meter = _Meter()
    num_preemptions = 0
    step = 0
    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(_Running(pending.popleft()))
        _admit(waiting, running, strategy, step)
        num_preemptions += _decode(waiting, running, strategy, step)
        meter.record(strategy, len(running) * config.num_samples, bool(waiting))
        running = _finish(running, strategy)
        step += 1
    return _result(strategy, config, meter, step, num_preemptions)


def _admit(waiting: deque[_Running], running: list[_Running], strategy: Strategy,
           step: int) -> None:
    while waiting and strategy.try_admit(waiting[0].request, waiting[0].num_generated):
        entry = waiting.popleft()
        entry.admitted_step = step
        running.append(entry)
    if waiting and not running:
        request = waiting[0].request
        raise ValueError(f"{strategy.name}: request {request.request_id} "
                         f"({request.prompt_len} + {request.output_len} tokens) cannot fit in "
                         f"the budget even with nothing else running")


def _decode(waiting: deque[_Running], running: list[_Running], strategy: Strategy,
            step: int) -> int:
    """Grow every request admitted before this step; returns the number of preemptions."""
    num_preemptions = 0
    index = 0
    while index < len(running):
        entry = running[index]
        if entry.admitted_step == step:
            index += 1
            continue
        if strategy.try_grow(entry.request):
            entry.num_generated += 1
            index += 1
            continue
        if len(running) == 1:
            raise ValueError(f"{strategy.name}: request {entry.request.request_id} outgrows "
                             f"the budget even with nothing else running")
        victim = running.pop()  # the youngest; may be `entry` itself, which ends the loop
        strategy.release(victim.request)
        waiting.appendleft(victim)
        num_preemptions += 1
    return num_preemptions


def _finish(running: list[_Running], strategy: Strategy) -> list[_Running]:
    still_running = []
    for entry in running:
        if entry.num_generated == entry.request.output_len:
            strategy.release(entry.request)
        else:
            still_running.append(entry)
    return still_running


def _result(strategy: Strategy, config: SimConfig, meter: _Meter, steps: int,
            num_preemptions: int) -> SimResult:
    num_bound_steps = int(meter.bound_sums[0])
    sums = meter.bound_sums if num_bound_steps else meter.all_sums
    num_steps, *byte_sums, fragmentation_sum = sums
    scale = num_steps * config.budget_bytes
    token_states, reservation, internal, free = (value / scale for value in byte_sums)
    activity = (strategy.arena_activity() if isinstance(strategy, ReportsArenaActivity)
                else ArenaActivity())
    return SimResult(
        strategy=strategy.name,
        block_size=strategy.block_size,
        steps=steps,
        num_preemptions=num_preemptions,
        peak_concurrency=max(meter.concurrency, default=0),
        mean_concurrency=sum(meter.concurrency) / max(steps, 1),
        token_state_fraction=token_states,
        reservation_fraction=reservation,
        internal_fragmentation=internal,
        free_fraction=free,
        external_fragmentation=fragmentation_sum / num_steps,
        num_memory_bound_steps=num_bound_steps,
        token_state_fraction_all_steps=meter.all_sums[1] / (steps * config.budget_bytes),
        concurrency=meter.concurrency,
        num_cache_hits=activity.num_cache_hits,
        num_compactions=activity.num_compactions,
        num_bytes_moved=activity.num_bytes_moved,
    )
