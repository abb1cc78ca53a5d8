"""The engine: requests in, one batched step at a time, outputs out.

A request's life: `add_request` hands it to the request intake
(`kvpool.engine.requests.intake`: tokenized, validated, prepared and its prompt's full blocks
hashed, once, at the edge) and queues its first sequence; steps prefill it (blocks from the
free list, cached prefix blocks shared), then decode it one token per step (a new block only
when the last is full); when it finishes every block goes back.

    step():  schedule → execute → sample → update → outputs

`scheduler.schedule()` picks the batch and reserves its slots; `runner.execute` runs the model
(and the batch's block copies); `sampler` picks one token per logits row; `scheduler.update`
marks what was computed, forks, appends, applies the stop rules and frees the finished; the
output processor turns every request that changed into a `RequestOutput` (cumulative, delta or
final only, as each request asks). A step whose tier copies, model or sampler raise is rolled
back (`Scheduler.roll_back`) before the error propagates, so the engine can go on.

KV moves between tiers (`kvpool.memory.tiers`: spills, swaps, reloads from host, disk or
Redis) by copies that scheduling queues and the step runs just before its model
(`before_step`). Everything else that follows KV memory is a listener on its one fan-out
(`kvpool.memory.kv_listener`), told of each request's arrival and end and of each step's end:
the tiers write the blocks a step published through to disk and Redis, the KV event log
(`kv_events_config`) numbers and publishes what the step changed in the prefix caches, the
`--kv-trace` recorder writes its lines, and the pool's rate window samples its counters. The
engine never branches on which of them exist. `close()` (also at garbage collection and exit)
finishes the copies and the disk's writes.

KV memory (`KVMemory`) resizes (an elastic pool grows or migrates blocks and shrinks) only at
the top of a step, before anything is scheduled: no slot mapping or block copy is in flight
then. With `kv_transfer_config` (disaggregated prefill and decode: `kvpool.engine.kv_connector`), a
prefill worker's finished request leases its prompt's blocks to a decode worker and its output
names them (`kv_transfer_params`); a decode worker's request first loads those blocks into its
prefix cache on a worker thread and is scheduled once they are in (`_take_loaded`), or, the
load failed, computes its prompt itself or fails (`kv_load_failure_policy`). Without it the
connector is `NoKVConnector`, which refuses kv_transfer_params.

At start-up a dummy batch warms the engine up (`kvpool.engine.warmup`), then every
counter is reset.

The engine holds its parts and nothing derived from them: the model's parts (`EngineParts`:
model config, tokenizer, device, dtype, KV memory, workers) are read through it, the counters
are `StepStats`' and the scheduler's, and what a request needs is prepared by the intake.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine_stats import EngineStats, PhaseClock, StepStats
from kvpool.engine.kv_connector.factory import make_kv_connector
from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.memory_stats import MemoryStats
from kvpool.engine.observability.recorder import KVRecorder
from kvpool.engine.observability.snapshot import take_kv_snapshot
from kvpool.engine.preemption import PreemptionPolicy
from kvpool.engine.requests.intake import PromptInput, RequestIntake
from kvpool.engine.requests.output_processor import OutputProcessor
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.engine.requests.prompt_limits import PromptLimits
from kvpool.engine.sampling import Sampler, SamplerOutput, sampling_rows
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpool.engine.sequence import FinishReason, Request
from kvpool.engine.setup import EngineParts, build_engine_parts, make_runner
from kvpool.engine.speculative import make_speculator
from kvpool.engine.warmup import warm_up
from kvpool.formats.kv_snapshot import KVSnapshot
from kvpool.memory.block_table import BlockTable
from kvpool.memory.kv_pool import KVPoolStats
from kvpool.memory.tiers.kv_tiers import KVTiers, KVTierStats
from kvpool.model.flops import prefill_flops

if TYPE_CHECKING:
    from kvpool.engine.observability.event_log import KVEventLog

__all__ = ["LLMEngine", "PromptInput"]

LOAD_WAIT_SECONDS = 0.02  # a step with nothing to run waits this long for a KV load at most


class LLMEngine:
    """Requests in, one batched step at a time, outputs out (module docstring)."""

    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        self.config = config
        self.parts = parts = parts or build_engine_parts(config)
        self.runner = make_runner(parts, config)
        self.intake = RequestIntake(parts.tokenizer, parts.model_config, parts.max_model_len,
                                    config.scheduling, parts.kv_memory, parts.device)
        self.outputs = OutputProcessor(parts.tokenizer, self.eos_token_ids, parts.max_model_len)
        self.scheduler = Scheduler(
            self._scheduler_config(), self._kv_manager(), stop_checker=self.outputs,
            speculator=make_speculator(config.scheduling.speculative_config, self.max_model_len))
        self.sampler = Sampler(config.load.seed)
        self.kv_connector = make_kv_connector(config.parallel.kv_transfer_config,
                                              parts.kv_memory, config.load.model)
        self.requests: dict[str, Request] = {}
        self.step_stats = StepStats()
        self.kv_recorder: KVRecorder | None = None  # --kv-trace: after the warm-up, not in it
        self.kv_events: KVEventLog | None = None  # kv_events_config: after the warm-up too
        # Finishes the tiers' copies and writes, then stops tensor parallelism's other ranks:
        # at close(), when the engine is collected, or at exit, whichever comes first.
        closers = [self.kv_connector.close, parts.kv_memory.tiers.close]
        if parts.workers is not None:
            closers.append(parts.workers.close)
        self._close = weakref.finalize(self, _close_all, closers)
        self.reset_stats()
        self.warmup_seconds = (warm_up(self, parts, self.runner, self.scheduler.kv.policy)
                               if config.load.enable_warmup else 0.0)
        self._start_observers()

    def _scheduler_config(self) -> SchedulerConfig:
        config = self.config
        return SchedulerConfig(
            max_num_seqs=config.scheduling.max_num_seqs,
            max_num_batched_tokens=config.scheduling.batched_tokens_limit(self.max_model_len),
            enable_chunked_prefill=config.scheduling.enable_chunked_prefill,
        )

    def _kv_manager(self) -> KVCacheManager:
        model_config = self.model_config
        policy = PreemptionPolicy(self.config.scheduling.preemption_mode,
                                  self.kv_memory.layout.bytes_per_block,
                                  lambda num_tokens: prefill_flops(model_config, num_tokens))
        return KVCacheManager(self.kv_memory, policy)

    def _start_observers(self) -> None:
        """The KV trace and the KV events, which hear only what follows the warm-up."""
        if self.config.observability.kv_trace is not None:
            self.kv_recorder = KVRecorder.start(self.config.observability.kv_trace, self.kv_memory)
            weakref.finalize(self, self.kv_recorder.close)
        events_config = self.config.observability.kv_events_config
        if events_config is not None and events_config.is_enabled:
            # pyzmq and msgspec are optional: imported only when events are on.
            from kvpool.engine.observability.publisher import start_kv_events

            self.kv_events = start_kv_events(events_config, self.kv_memory, self)

    # ------------------------------------------------------------ the model's parts
    @property
    def model_config(self):
        return self.parts.model_config

    @property
    def tokenizer(self):
        return self.parts.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.parts.max_model_len

    @property
    def device(self):
        return self.parts.device

    @property
    def dtype(self):
        """The model's and the KV cache's dtype ("auto" already resolved)."""
        return self.parts.dtype

    @property
    def kv_memory(self):
        return self.parts.kv_memory

    @property
    def kv_tiers(self) -> KVTiers:
        return self.parts.kv_memory.tiers

    @property
    def workers(self):
        """Tensor parallelism's other ranks (None at tp=1)."""
        return self.parts.workers

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.intake.eos_token_ids

    @property
    def prompt_limits(self) -> PromptLimits:
        """How long a prompt may be (tokens, and characters before tokenizing): the rule the
        intake applies, for callers that check ahead (the server)."""
        return self.intake.prompt_limits

    @property
    def grammar_compiler(self):
        """Structured outputs' grammars (None without a tokenizer): callers may compile
        ahead, off the step loop."""
        return self.intake.grammar_compiler

    def reset_stats(self) -> None:
        """Zero every counter and return KV memory to its start-up state; only while no
        request is unfinished (the warm-up calls it; so may a benchmark between phases)."""
        if self.requests:
            raise ValueError(f"cannot reset with {len(self.requests)} unfinished requests")
        self.step_stats.reset()
        self.scheduler.reset_counters()
        self.kv_memory.reset()  # the listeners hear it (pool_cleared)

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a prompt (text, token ids, or {"prompt_token_ids": [...]}); InvalidRequestError
        (a ValueError naming the field) if it can never run. A structured request's grammar
        comes from `grammar_compiler`'s cache, or is compiled here (callers that can compile
        ahead, off the step loop, do: the async engine, the server)."""
        request, block_hashes = self.intake.make_request(prompt, params, request_id, priority,
                                                         cache_salt, self.requests)
        self.kv_connector.accept(request)
        self.kv_memory.listeners.request_arrived(request.request_id,
                                                 len(request.prompt_token_ids),
                                                 request.params.n, block_hashes)
        self.requests[request.request_id] = request
        # A prompt computed elsewhere is scheduled once its KV is loaded (`_take_loaded`).
        if not self.kv_connector.start_load_kv(request, block_hashes, time.monotonic()):
            self.scheduler.add_request(request, block_hashes)
        self.step_stats.num_prompt_tokens += len(request.prompt_token_ids)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, wherever it is; its blocks return to the pool at once. Returns
        its final output (finish reason "abort"), or None for an unknown id."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            self.scheduler.finish(seq, FinishReason.ABORT)
        self.kv_connector.abort(request_id)
        request.finish_time = time.monotonic()
        self._tell_finished(request, FinishReason.ABORT)
        return self.outputs.make_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.kv_connector.has_pending

    def request_counts(self) -> tuple[int, int]:
        """(running requests, waiting requests): a request whose KV is being loaded from a
        prefill worker waits."""
        running, waiting = self.scheduler.request_counts()
        return running, waiting + self.kv_connector.num_pending

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that changed (and whose output
        kind hands one out now)."""
        clock = self._start_step()
        started = clock.last
        failed = self._take_loaded(started)  # requests whose KV load failed, policy "fail"
        batch = self._schedule()
        clock.lap("schedule")
        changed = self.scheduler.update(batch, self._execute_and_sample(batch, clock))
        clock.lap("sample")
        self.scheduler.speculator.observe_step(batch.chunks, clock.last - started)
        outputs = self._make_outputs([*failed, *changed])
        self.kv_memory.listeners.step_ended(self.step_stats.num_steps)
        clock.lap("output")
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The step's batch; an empty one while KV loads run waits a moment for one."""
        batch = self.scheduler.schedule()
        if not batch.chunks and self.kv_connector.has_pending:
            self.kv_connector.wait_for_load(LOAD_WAIT_SECONDS)
        return batch

    def _take_loaded(self, now: float) -> list[Request]:
        """Requests whose KV load ended join the scheduler (loaded, or to compute their prompt
        here: kv_load_failure_policy "recompute"); those the policy fails are returned,
        finished with their error."""
        failed = []
        for loaded in self.kv_connector.get_finished(now):
            request = loaded.request
            if loaded.error is None:
                self.scheduler.add_request(request, loaded.block_hashes)
                continue
            request.error = f"loading the prompt's KV from the prefill worker failed: " \
                            f"{loaded.error}"
            failed.append(request)
        return failed

    def _start_step(self) -> PhaseClock:
        """Set the CPU threads, stamp the pools' clocks and resize KV memory, before anything
        is scheduled."""
        clock = self.step_stats.clock()
        now = time.monotonic()
        self.parts.cpu_threads.before_step(now)
        self.kv_memory.set_clock(now)
        self.resize_kv_pool()
        return clock

    def _execute_and_sample(self, batch: SchedulerOutput, clock: PhaseClock) -> SamplerOutput:
        """The tiers' copies, the model and the sampler; if any raises, the step is rolled
        back first."""
        num_used_blocks = self.kv_memory.pool.num_used_blocks
        try:
            self.kv_memory.before_step(batch.written_block_ids)
            if not batch.chunks:
                return SamplerOutput(token_ids=[], logprobs=[])
            logits = self.runner.execute(batch.chunks, batch.block_copies)
            model_seconds = clock.lap("model")
            sampled = self.sampler(logits.sampling,
                                   sampling_rows(batch, self.eos_token_ids))
            self.outputs.add_prompt_logprobs(batch.chunks, logits.prompt)
        except BaseException:
            self.scheduler.roll_back(batch)
            raise
        is_decode_only = all(chunk.num_new_tokens == 1 for chunk in batch.chunks)
        self.step_stats.record_model_run(num_used_blocks, model_seconds, is_decode_only)
        return sampled

    def _make_outputs(self, changed: list[Request]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for request in changed:
            if request.sequences and request.sequences[0].output_token_ids:
                request.record_new_tokens(now)
            if request.is_finished:
                request.finish_time = now
                self.requests.pop(request.request_id, None)
                self._tell_finished(request)
            output = self.outputs.make_output(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def _tell_finished(self, request: Request, why: FinishReason | None = None) -> None:
        """The listeners hear of a finished request: its longest completion's length and
        (unless `why` says, e.g. abort) that completion's finish reason."""
        if why is None and request.error is None:
            request.kv_transfer_params = self.kv_connector.request_finished(request,
                                                                            time.monotonic())
        longest = max(request.sequences, key=lambda seq: len(seq.output_token_ids),
                      default=None)
        reason = why if why is not None or longest is None else longest.finish_reason
        num_output_tokens = 0 if longest is None else len(longest.output_token_ids)
        self.kv_memory.listeners.request_finished(request.request_id, num_output_tokens,
                                                  str(reason or "error"))

    # ------------------------------------------------------------ KV pool
    def resize_kv_pool(self) -> None:
        """Let KV memory grow or give memory back now: leases released or expired end (their
        blocks go back), then an elastic pool resizes. `step()` does this first; an idle
        server loop calls it between steps so that idle memory is still given back."""
        now = time.monotonic()
        self.kv_connector.tick(now)
        self.kv_memory.maybe_resize(now, self._live_block_tables())
        if self.kv_events is not None:  # a shrink's evictions, published even when idle
            self.kv_events.drain()

    def _live_block_tables(self) -> Iterator[BlockTable]:
        """Every block table that may hold blocks (lazy: read only if blocks must move)."""
        for request in self.requests.values():
            for seq in request.sequences:
                yield seq.block_table

    # ------------------------------------------------------------ reporting
    def memory_stats(self) -> MemoryStats:
        """The block pool's snapshot, with the maximum concurrency at `max_model_len`."""
        memory = self.kv_memory
        return MemoryStats.of(memory.block_stats(), memory.max_num_blocks, self.max_model_len,
                              memory.max_concurrency(self.max_model_len))

    def kv_pool_stats(self) -> KVPoolStats:
        """The KV memory: online blocks, segments, grows, shrinks, migrations, arena bytes."""
        return self.kv_memory.pool_stats()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return self.step_stats.record(scheduler.num_preemptions, scheduler.num_recomputed_tokens,
                                      scheduler.num_output_tokens, scheduler.kv.counters,
                                      self.kv_memory.layout.bytes_per_block,
                                      scheduler.speculator.stats())

    def kv_snapshot(self) -> KVSnapshot:
        """Every block (with a KV producer's leases on it), every block table and the derived
        figures, as of now (between steps: the async engine takes it on its own thread);
        `kvpool.engine.observability.snapshot`."""
        self.kv_memory.set_clock(time.monotonic())
        return take_kv_snapshot(self.kv_memory, self.requests.values(),
                                self.scheduler.kv.swapped_kv,
                                self.step_stats.num_steps, self.kv_memory.rates.rates(),
                                self.kv_connector.leased_block_ids())

    def kv_tier_stats(self) -> KVTierStats:
        """The host and disk tiers: their blocks, spills, reloads and swaps."""
        return self.kv_tiers.stats()

    def close(self) -> None:
        """Finish the KV tiers' copies and the disk tier's writes and stop the tensor-parallel
        workers (once; also run when the engine is garbage-collected and at exit); write out
        the KV trace, and stop it; publish the last KV events and close their socket."""
        self._close()
        if self.kv_recorder is not None:
            self.kv_recorder.close()
            self.kv_recorder = None
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel worker died or hung), or
        None while it can; safe to read from any thread."""
        return None if self.workers is None else self.workers.failure_reason()

    def check_invariants(self) -> None:
        """Assert the scheduler's and KV memory's invariants (O(everything); for tests)."""
        sequences = [seq for request in self.requests.values() for seq in request.sequences]
        self.scheduler.check_invariants(sequences)
        self.kv_memory.check_invariants(self.scheduler.kv.swapped)

    def default_sampling_params(self) -> dict[str, float]:
        """SamplingParams field -> value for the fields the model's generation config sets
        (vLLM's `generation_config="auto"`; `kvpool.engine.generation_config`): the defaults
        of a request that leaves them out. Empty when the model sets none. A copy."""
        return dict(self.parts.default_sampling_params)


def _close_all(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        close()
