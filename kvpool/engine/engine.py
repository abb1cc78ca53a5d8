"""The engine: requests in, one batched step at a time, outputs out.

A request's life: `add_request` creates its first sequence and block table and queues it;
steps prefill it (blocks from the free list, cached prefix blocks shared), then decode it one
token per step (a new block only when the last is full); when it finishes every block goes back.

    step():  kv_pool.maybe_resize() → scheduler.schedule() → runner.execute(batch)
             → sampler(logits) → outputs.append_token → scheduler.finish(finished sequences)

The KV pool resizes (an elastic pool grows or migrates blocks and shrinks) only at the top of
a step, before anything is scheduled: no slot mapping or block copy is in flight then. At
start-up a dummy batch warms the engine up (`kvpool.engine.warmup`), then every counter is reset.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.model_runner import ModelRunner, SequenceChunk
from kvpool.engine.output_processor import OutputProcessor
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampler import Sampler, SamplingRow
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpool.engine.sequence import FinishReason, Request, Sequence
from kvpool.engine.setup import EngineParts, build_engine_parts
from kvpool.engine.warmup import warm_up
from kvpool.memory.block_pool import BlockPoolStats
from kvpool.memory.block_table import BlockTable
from kvpool.memory.elastic_pool import KVPoolStats

PromptInput = str | SequenceOf[int] | dict


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters over the engine's life, for reports and metrics."""

    num_steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    peak_used_blocks: int
    num_prompt_tokens: int
    num_generated_tokens: int
    phase_seconds: dict[str, float]  # wall time per step phase: schedule, model, sample, output
    decode_only_model_seconds: float  # the part of phase "model" in steps with no prefill chunk


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        self.config = config
        parts = parts or build_engine_parts(config)
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.kv_cache = parts.kv_cache
        self.kv_pool = parts.kv_pool
        self.runner = ModelRunner(parts.model, parts.kv_cache, parts.device)
        watermark_blocks = int(config.watermark * parts.kv_pool.max_num_blocks)
        self.kv_manager = KVCacheManager(parts.pool, watermark_blocks, parts.kv_pool)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.batched_tokens_limit(parts.max_model_len),
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.kv_manager,
        )
        self.sampler = Sampler(config.seed)
        eos_ids = parts.tokenizer.eos_token_ids if parts.tokenizer else ()
        self.eos_token_ids = frozenset(eos_ids) | frozenset(parts.model_config.eos_token_ids)
        self.outputs = OutputProcessor(parts.tokenizer, self.eos_token_ids, parts.max_model_len)
        self.requests: dict[str, Request] = {}
        self.reset_stats()
        self.warmup_seconds = warm_up(self) if config.enable_warmup else 0.0

    def reset_stats(self) -> None:
        """Zero every counter and return the KV pool to its start-up state; only while no
        request is unfinished (the warm-up calls it; so may a benchmark between phases)."""
        if self.requests:
            raise ValueError(f"cannot reset with {len(self.requests)} unfinished requests")
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._num_steps = 0
        self._peak_used_blocks = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._phase_seconds = dict.fromkeys(("schedule", "model", "sample", "output"), 0.0)
        self._decode_only_model_seconds = 0.0
        self.scheduler.num_preemptions = 0
        self.scheduler.num_recomputed_tokens = 0
        self.kv_pool.reset()

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a prompt (text, token ids, or {"prompt_token_ids": [...]}); ValueError if it
        can never run (too long for the model or for the whole KV pool)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_text, token_ids = self._tokenize(prompt)
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        self._validate(request_id, token_ids, params)
        request = Request(
            request_id, prompt_text, token_ids, params, time.monotonic(), priority, cache_salt
        )
        request.sequences.append(self._new_sequence(request, index=0))
        self.requests[request_id] = request
        self.scheduler.add(request.sequences[0])
        self._num_prompt_tokens += len(token_ids)
        return request

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab_size = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len} (room is needed for at least one output token)"
            )
        if not self.kv_manager.can_ever_fit(len(token_ids) + 1):
            capacity = self.kv_pool.max_num_blocks * self.pool.block_size
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but the whole KV pool holds only "
                f"{capacity} tokens: it could never run"
            )
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary ({vocab_size})")
        if any(token_id >= vocab_size for token_id in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            index=index,
            block_table=self.kv_manager.new_block_table(request.cache_salt),
            generator=_sequence_generator(request.params.seed, index),
        )
        self.outputs.start(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, wherever it is; its blocks return to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            self.scheduler.finish(seq, FinishReason.ABORT)
        request.finish_time = time.monotonic()
        return self.outputs.make_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that changed."""
        clock = _PhaseClock(self._phase_seconds)
        self.resize_kv_pool()
        batch = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        for seq in batch.length_capped:
            self._finish(seq, FinishReason.LENGTH, None, touched)
        clock.lap("schedule")
        if batch.chunks:
            self._peak_used_blocks = max(self._peak_used_blocks, self.pool.num_used_blocks)
            logits = self.runner.execute(self._model_chunks(batch), batch.block_copies)
            model_seconds = clock.lap("model")
            if all(chunk.num_new_tokens == 1 for chunk in batch.chunks):
                self._decode_only_model_seconds += model_seconds
            self.scheduler.mark_computed(batch)
            self._sample_and_append(batch, logits, touched)
            self._num_steps += 1
            clock.lap("sample")
        outputs = [self.outputs.make_output(request) for request in touched.values()]
        for request in touched.values():
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        clock.lap("output")
        return outputs

    def _model_chunks(self, batch: SchedulerOutput) -> list[SequenceChunk]:
        chunks = []
        for chunk in batch.chunks:
            start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
            chunks.append(
                SequenceChunk(
                    token_ids=chunk.seq.token_ids(start, end),
                    num_computed_tokens=start,
                    block_ids=chunk.seq.block_table.block_ids,
                    needs_logits=chunk.completes_sequence,
                )
            )
        return chunks

    def _sample_and_append(
        self, batch: SchedulerOutput, logits: torch.Tensor, touched: dict[str, Request]
    ) -> None:
        seqs: list[Sequence] = []
        row_indices: list[int] = []
        completing = [chunk.seq for chunk in batch.chunks if chunk.completes_sequence]
        for row, seq in enumerate(completing):
            for member in self._fork_if_needed(seq):
                seqs.append(member)
                row_indices.append(row)
        rows = [self._sampling_row(seq) for seq in seqs]
        if len(row_indices) != logits.shape[0]:  # forked rows repeat their parent's logits
            logits = logits[torch.tensor(row_indices, device=logits.device)]
        sampled = self.sampler(logits, rows)
        now = time.monotonic()
        for seq, token_id, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
            request = seq.request
            request.first_token_time = request.first_token_time or now
            touched[request.request_id] = request
            self._num_generated_tokens += 1
            decision = self.outputs.append_token(seq, token_id, logprobs)
            if decision is not None:
                self._finish(seq, decision[0], decision[1], touched)

    def _fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        """At the end of a prompt's prefill, the request's other n - 1 sequences are born
        sharing its blocks; all n sample their first token from the same logits."""
        request = seq.request
        if not request.needs_fork or seq.output_token_ids:
            return [seq]
        children = []
        for index in range(len(request.sequences), request.params.n):
            child = self._new_sequence(request, index)
            request.sequences.append(child)
            self.scheduler.fork(seq, child)
            children.append(child)
        return [seq, *children]

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.request.params
        banned: tuple[int, ...] = ()
        if len(seq.output_token_ids) < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            banned = eos + tuple(params.stop_token_ids)
        return SamplingRow(
            params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, banned
        )

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        stop_reason: str | int | None,
        touched: dict[str, Request],
    ) -> None:
        self.outputs.flush(seq, reason, stop_reason)
        self.scheduler.finish(seq, reason)
        touched[seq.request.request_id] = seq.request
        if seq.request.is_finished:
            seq.request.finish_time = time.monotonic()

    # ------------------------------------------------------------ KV pool
    def resize_kv_pool(self) -> None:
        """Let the KV pool grow or give memory back now. `step()` does this first; an idle
        server loop may call it between steps so that idle memory is still given back."""
        self.kv_pool.maybe_resize(time.monotonic(), self._live_block_tables())

    def _live_block_tables(self) -> Iterator[BlockTable]:
        """Every block table that may hold blocks (lazy: read only if blocks must move)."""
        for request in self.requests.values():
            for seq in request.sequences:
                yield seq.block_table

    # ------------------------------------------------------------ reporting
    def memory_stats(self) -> BlockPoolStats:
        return self.pool.stats()

    def kv_pool_stats(self) -> KVPoolStats:
        """The KV memory: online blocks, segments, grows, shrinks, migrations, arena bytes."""
        return self.kv_pool.stats()

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
        )


class _PhaseClock:
    """Adds the wall time since the previous lap to a named phase."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def lap(self, phase: str) -> float:
        """Charge the time since the previous lap to `phase`; return it (seconds)."""
        now = time.perf_counter()
        seconds = now - self.last
        self.totals[phase] += seconds
        self.last = now
        return seconds


def _sequence_generator(seed: int | None, index: int) -> torch.Generator | None:
    """A private random stream per seeded sequence: completion `index` of seed s is the same
    whatever else runs in the batch."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed((seed * 0x9E3779B97F4A7C15 + index) % 2**63)
    return generator
