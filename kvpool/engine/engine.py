"""The engine: requests in, one batched step at a time, outputs out.

A request's life: `add_request` hashes its prompt's full blocks once and queues its first
sequence; steps prefill it (blocks from the free list, cached prefix blocks shared), then decode
it one token per step (a new block only when the last is full); when it finishes every block
goes back.

    step():  schedule → execute → sample → update → outputs

`scheduler.schedule()` picks the batch and reserves its slots; `runner.execute` runs the model
(and the batch's block copies); `sampler` picks one token per logits row; `scheduler.update`
marks what was computed, forks, appends, applies the stop rules and frees the finished; the
output processor turns every request that changed into a `RequestOutput` (cumulative, delta or
final only, as each request asks). A step whose model or sampler raises is rolled back
(`Scheduler.roll_back`) before the error propagates, so the engine can go on.

KV moves between tiers (`kvpool.memory.kv_tiers`: spills, swaps, reloads from host or disk) by
copies that scheduling queues and the step runs just before its model (`before_step`); the
blocks a step published are written through to the disk tier after it (`after_step`), and,
with `kv_events_config`, what it changed in the prefix caches goes out as one numbered batch
of KV events (`kvpool.engine.kv_events`). `close()` (also at garbage collection and exit)
finishes the copies and the disk's writes.

KV memory (`KVMemory`) resizes (an elastic pool grows or migrates blocks and shrinks) only at
the top of a step, before anything is scheduled: no slot mapping or block copy is in flight
then. At start-up a dummy batch warms the engine up (`kvpool.engine.warmup`), then every
counter is reset.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine_stats import EngineStats, PhaseClock, swap_stats
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.grammar import GrammarCompiler
from kvpool.engine.kv_event_publisher import KVEventLog, start_kv_events
from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.kv_recorder import KVRecorder
from kvpool.engine.kv_snapshot import take_kv_snapshot
from kvpool.engine.output_processor import OutputProcessor
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.preemption import PreemptionPolicy
from kvpool.engine.request_state import (
    bad_words_token_ids,
    cache_salt_key,
    grammar_matchers,
    sequence_generators,
)
from kvpool.engine.request_validation import validate_request
from kvpool.engine.sampling import Sampler, SamplerOutput, sampling_rows
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpool.engine.sequence import FinishReason, Request
from kvpool.engine.setup import EngineParts, build_engine_parts, make_runner
from kvpool.engine.warmup import warm_up
from kvpool.memory.block_pool_stats import BlockPoolStats
from kvpool.memory.block_table import BlockTable
from kvpool.memory.kv_pool import KVPoolStats
from kvpool.memory.kv_tiers import KVTierStats
from kvpool.memory.pool_rates import PoolRateWindow
from kvpool.memory.pool_snapshot import KVSnapshot
from kvpool.memory.prefix_cache import hash_full_blocks
from kvpool.model.flops import prefill_flops

PromptInput = str | SequenceOf[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        self.config = config
        parts = parts or build_engine_parts(config)
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.device = parts.device
        self.dtype = parts.dtype  # the model's and the KV cache's ("auto" already resolved)
        self._default_sampling_params = parts.default_sampling_params
        self.kv_memory = parts.kv_memory
        self.runner = make_runner(parts)
        # Tensor parallelism's other ranks (None at tp=1): stopped at close, collection, exit.
        self.workers = parts.workers
        self._close_workers = (None if parts.workers is None
                               else weakref.finalize(self, parts.workers.close))
        eos_ids = parts.tokenizer.eos_token_ids if parts.tokenizer else ()
        self.eos_token_ids = frozenset(eos_ids) | frozenset(parts.model_config.eos_token_ids)
        self.outputs = OutputProcessor(parts.tokenizer, self.eos_token_ids, parts.max_model_len)
        # Structured outputs' grammars (None without a tokenizer): callers may compile ahead.
        self.grammar_compiler = None if parts.tokenizer is None else GrammarCompiler(
            parts.tokenizer, parts.model_config.vocab_size, self.eos_token_ids)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.batched_tokens_limit(parts.max_model_len),
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        policy = PreemptionPolicy(config.preemption_mode, self.kv_memory.layout.bytes_per_block,
                                  lambda num_tokens: prefill_flops(parts.model_config, num_tokens))
        kv_manager = KVCacheManager(self.kv_memory, policy)
        self.kv_tiers = self.kv_memory.tiers
        self._close_tiers = weakref.finalize(self, self.kv_tiers.close)
        self.scheduler = Scheduler(scheduler_config, kv_manager, stop_checker=self.outputs)
        self.sampler = Sampler(config.seed)
        self.requests: dict[str, Request] = {}
        self._request_ids = itertools.count()
        self.kv_rates = PoolRateWindow()  # the device pool's alloc/free rates, for snapshots
        self.kv_recorder: KVRecorder | None = None  # --kv-trace: after the warm-up, not in it
        self.kv_events: KVEventLog | None = None  # kv_events_config: after the warm-up too
        self.reset_stats()
        self.warmup_seconds = warm_up(self) if config.enable_warmup else 0.0
        if config.kv_trace is not None:
            self.kv_recorder = KVRecorder.start(config.kv_trace, self.kv_memory, kv_manager)
            weakref.finalize(self, self.kv_recorder.close)
        self.kv_events = start_kv_events(config.kv_events_config, self.kv_memory, self)

    def reset_stats(self) -> None:
        """Zero every counter and return KV memory to its start-up state; only while no
        request is unfinished (the warm-up calls it; so may a benchmark between phases)."""
        if self.requests:
            raise ValueError(f"cannot reset with {len(self.requests)} unfinished requests")
        self._num_steps = 0
        self._peak_used_blocks = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._phase_seconds = dict.fromkeys(("schedule", "model", "sample", "output"), 0.0)
        self._decode_only_model_seconds = 0.0
        self.scheduler.num_preemptions = 0
        self.scheduler.num_recomputed_tokens = 0
        self.scheduler.kv.reset_counters()
        self.kv_memory.reset()
        self.kv_rates.clear()

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
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_text, token_ids = self._tokenize(prompt)
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        validate_request(self, request_id, token_ids, params)
        salt = cache_salt_key(cache_salt)
        request = Request(request_id, prompt_text, token_ids, params, time.monotonic(), salt,
                          sequence_generators(params.seed, params.n, self.device), priority,
                          cache_salt, grammar_matchers(params, self.grammar_compiler),
                          bad_words_token_ids(params.bad_words, self.tokenizer,
                                              self.model_config.vocab_size))
        block_hashes = hash_full_blocks(token_ids, self.kv_memory.layout.block_size, salt)
        if self.kv_recorder is not None:
            self.kv_recorder.arrive(request_id, len(token_ids), params.n, block_hashes)
        self.scheduler.add_request(request, block_hashes)
        self.requests[request_id] = request
        self._num_prompt_tokens += len(token_ids)
        return request

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: give prompts as token ids", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, wherever it is; its blocks return to the pool at once. Returns
        its final output (finish reason "abort"), or None for an unknown id."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            self.scheduler.finish(seq, FinishReason.ABORT)
        request.finish_time = time.monotonic()
        if self.kv_recorder is not None:
            self.kv_recorder.finish(request, str(FinishReason.ABORT))
        return self.outputs.make_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_counts(self) -> tuple[int, int]:
        """(running requests, waiting requests)."""
        return self.scheduler.request_counts()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that changed (and whose output
        kind hands one out now)."""
        clock = PhaseClock(self._phase_seconds)
        if self.kv_recorder is not None:
            self.kv_recorder.step = self._num_steps
        self._set_pool_clocks(time.monotonic())
        self.resize_kv_pool()
        batch = self.scheduler.schedule()
        clock.lap("schedule")
        sampled = self._execute_and_sample(batch, clock)
        changed = self.scheduler.update(batch, sampled)
        self.kv_tiers.after_step()  # what this step published, written through to disk
        if self.kv_events is not None:  # this step's KV events, numbered and published
            self.kv_events.drain()
        pool = self.kv_memory.pool
        self.kv_rates.sample(pool.now, *pool.allocation_counters())
        clock.lap("sample")
        outputs = self._make_outputs(changed)
        if self.kv_recorder is not None:
            self.kv_recorder.end_step(pool, self._num_steps)
        clock.lap("output")
        return outputs

    def _execute_and_sample(self, batch: SchedulerOutput, clock: PhaseClock) -> SamplerOutput:
        """The tiers' copies, the model and the sampler; if any raises, the step is rolled
        back first."""
        self.kv_tiers.before_step(batch.written_block_ids)
        if not batch.chunks:
            return SamplerOutput(token_ids=[], logprobs=[])
        self._peak_used_blocks = max(self._peak_used_blocks,
                                     self.kv_memory.pool.num_used_blocks)
        try:
            logits = self.runner.execute(batch.chunks, batch.block_copies)
            model_seconds = clock.lap("model")
            sampled = self.sampler(logits.sampling,
                                   sampling_rows(batch, self.eos_token_ids))
            self.outputs.add_prompt_logprobs(batch.chunks, logits.prompt)
        except BaseException:
            self.scheduler.roll_back(batch)
            raise
        if all(chunk.num_new_tokens == 1 for chunk in batch.chunks):
            self._decode_only_model_seconds += model_seconds
        self._num_steps += 1
        self._num_generated_tokens += len(sampled.token_ids)
        return sampled

    def _make_outputs(self, changed: list[Request]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for request in changed:
            if request.sequences[0].output_token_ids:
                request.record_new_tokens(now)
            if request.is_finished:
                request.finish_time = now
                self.requests.pop(request.request_id, None)
                if self.kv_recorder is not None:
                    self.kv_recorder.finish(request)
            output = self.outputs.make_output(request)
            if output is not None:
                outputs.append(output)
        return outputs

    # ------------------------------------------------------------ KV pool
    def _set_pool_clocks(self, now: float) -> None:
        """The pools stamp blocks with this time as they change hands (their last-use age)."""
        self.kv_memory.pool.now = now
        if self.kv_tiers.host is not None:
            self.kv_tiers.host.pool.now = now

    def resize_kv_pool(self) -> None:
        """Let KV memory grow or give memory back now. `step()` does this first; an idle
        server loop may call it between steps so that idle memory is still given back."""
        self.kv_memory.maybe_resize(time.monotonic(), self._live_block_tables())
        if self.kv_events is not None:  # a shrink's evictions, published even when idle
            self.kv_events.drain()

    def _live_block_tables(self) -> Iterator[BlockTable]:
        """Every block table that may hold blocks (lazy: read only if blocks must move)."""
        for request in self.requests.values():
            for seq in request.sequences:
                yield seq.block_table

    # ------------------------------------------------------------ reporting
    def memory_stats(self) -> BlockPoolStats:
        return self.kv_memory.block_stats()

    def kv_pool_stats(self) -> KVPoolStats:
        """The KV memory: online blocks, segments, grows, shrinks, migrations, arena bytes."""
        return self.kv_memory.pool_stats()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_steps=self._num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
            peak_used_blocks=self._peak_used_blocks,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens,
            phase_seconds=dict(self._phase_seconds),
            decode_only_model_seconds=self._decode_only_model_seconds,
            **swap_stats(self.scheduler.kv.counters, self.kv_memory.layout.bytes_per_block),
        )

    def kv_snapshot(self) -> KVSnapshot:
        """Every block, every block table and the derived figures, as of now (between steps:
        the async engine takes it on its own thread); `kvpool.engine.kv_snapshot`."""
        self._set_pool_clocks(time.monotonic())
        return take_kv_snapshot(self)

    def kv_tier_stats(self) -> KVTierStats:
        """The host and disk tiers: their blocks, spills, reloads and swaps."""
        return self.kv_tiers.stats()

    def close(self) -> None:
        """Finish the KV tiers' copies and the disk tier's writes (idempotent; also run when
        the engine is garbage-collected and at exit); write out the KV trace, and stop it;
        stop the tensor-parallel workers; publish the last KV events and close their socket."""
        self._close_tiers()
        if self.kv_recorder is not None:
            self.kv_recorder.close()
            self.kv_recorder = None
        if self._close_workers is not None:
            self._close_workers()
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
        self.kv_memory.check_invariants(self.scheduler.kv.num_swapped_host_blocks)

    def default_sampling_params(self) -> dict[str, float]:
        """SamplingParams field -> value for the fields the model's generation config sets
        (vLLM's `generation_config="auto"`; `kvpool.engine.generation_config`): the defaults
        of a request that leaves them out. Empty when the model sets none. A copy."""
        return dict(self._default_sampling_params)
