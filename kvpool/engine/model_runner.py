"""Turns one scheduled step into tensors, runs the model, and returns the logits it asked for.

The scheduler speaks in sequences and block tables; the model speaks in flat token ids,
positions and a `KVStep` (each layer's KV view and `AttentionMetadata`). The runner translates:
it orders the step's chunks decode first (so backends can launch one kernel per kind), flattens
their tokens, and computes each new token's slot from its block table (`KVLayout.slot_mapping`),
once per KV cache group: a sliding-window group's table names other blocks than the full
group's (`kvpool.memory.kv_groups`), so each group gets its own slots and block tables, and
each layer its group's.

A chunk asks for two kinds of logits rows. `num_samples` rows of its last token: 0 mid-prompt,
usually 1, n where a prompt's last chunk is sampled once per completion to be forked; a chunk
ending with k drafts (speculative decoding) asks instead for one row at each of its last k + 1
tokens, the positions that verify the drafts. And one
row per position of `prompt_logprob_positions`, for a request that asked for prompt logprobs.
The model computes them in one call (its `logits_indices` list the sampling rows of every chunk,
then the prompt-logprob rows of every chunk, each in the caller's chunk order), and `execute` splits
them into `StepLogits`: the sampler gets exactly one row per sequence, in order, and nothing is
re-indexed after the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpool.attention.kv_step import KVStep
from kvpool.attention.metadata import AttentionMetadata
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout


class ModelChunk(Protocol):
    """One sequence's share of a step: `token_ids` are new this step and follow
    `num_computed_tokens` tokens whose KV is already cached in `group_block_ids` (each KV cache
    group's blocks; one group's for most models); the step returns
    `num_samples` logits rows of its last token (with `num_draft_tokens` k: one row at each of
    its last k + 1 tokens instead), and one row per position (absolute, among the chunk's) of
    `prompt_logprob_positions`. The scheduler's `ScheduledChunk` is one."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def group_block_ids(self) -> Sequence[Sequence[int]]: ...

    @property
    def num_samples(self) -> int: ...

    @property
    def num_draft_tokens(self) -> int: ...

    @property
    def prompt_logprob_positions(self) -> range: ...


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """A plain `ModelChunk` (for callers without a scheduler: tests, tools)."""

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]
    num_samples: int = 1
    prompt_logprob_positions: range = range(0)
    num_draft_tokens: int = 0
    other_group_block_ids: tuple[Sequence[int], ...] = ()  # a hybrid pool's groups past the first

    @property
    def group_block_ids(self) -> tuple[Sequence[int], ...]:
        return (self.block_ids, *self.other_group_block_ids)


class CausalLM(Protocol):
    def __call__(
        self,
        token_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv: KVStep,  # each layer's KV view, scales and attention plan
        logits_indices: torch.Tensor,  # [num_logits] int64
    ) -> torch.Tensor:  # [num_logits, vocab_size] float32
        ...


@dataclass(frozen=True, slots=True)
class StepInputs:
    token_ids: torch.Tensor
    positions: torch.Tensor
    plans: tuple[AttentionMetadata, ...]  # one per KV cache group
    logits_indices: torch.Tensor  # the sampling rows, then the prompt-logprob rows
    num_sampling_rows: int
    # Every chunk one new token, sampled once, no prompt rows: logits row i is token i's
    # (what a CUDA-graphed decode replays: `kvpool.engine.decode_graphs`).
    is_pure_decode: bool = False

    @property
    def metadata(self) -> AttentionMetadata:
        """The batch's plan (the first group's: every group's has the same rows)."""
        return self.plans[0]


@dataclass(frozen=True, slots=True)
class StepLogits:
    """A step's logits, split by use; each part lists its chunks' rows in the caller's order."""

    sampling: torch.Tensor  # [sum of num_samples, vocab]: one row per sampled sequence
    prompt: torch.Tensor  # [sum of len(prompt_logprob_positions), vocab]


class ModelRunner:
    """Runs a `CausalLM` over a `KVCache`, one step at a time."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device | str = "cpu"):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(
        self, chunks: Sequence[ModelChunk], block_copies: Sequence[BlockCopy] = ()
    ) -> StepLogits:
        """Apply pending block copies, run the step, return its logits split into sampling
        rows and prompt-logprob rows. The inputs are prepared once here; `run_step` is where a
        subclass changes how the step runs (tensor parallelism shares it with its workers)."""
        inputs = self.prepare(chunks) if chunks else None
        logits = self.run_step(tuple(block_copies), inputs)
        if inputs is None or logits is None:
            empty = torch.empty(0, device=self.device)
            return StepLogits(empty, empty)
        split = inputs.num_sampling_rows
        return StepLogits(logits[:split], logits[split:])

    def run_step(
        self, block_copies: tuple[BlockCopy, ...], inputs: StepInputs | None
    ) -> torch.Tensor | None:
        """The copies, then the model on prepared inputs (None: a step of copies only);
        returns the logits rows `inputs.logits_indices` asked for, None without inputs or
        where this process's model returns none (a tensor-parallel worker's shard)."""
        self.kv_cache.copy_blocks(block_copies)
        if inputs is None:
            return None
        return self.model(inputs.token_ids, inputs.positions, self.kv_step(inputs),
                          inputs.logits_indices)

    def kv_step(self, inputs: StepInputs) -> KVStep:
        """This process's KV views under the step's plans."""
        cache = self.kv_cache
        return KVStep.build(cache.layer_views, cache.scale_views, inputs.plans, cache.layer_groups)

    def prepare(self, chunks: Sequence[ModelChunk]) -> StepInputs:
        """Flatten the chunks (decodes first) into the model's inputs.

        Attention sees one row per decode token: a decode's one token, and each token of a
        decode followed by drafts (the i-th attending to the context and the i tokens before
        it), so a verification runs on the decode kernels rather than a prefill's.
        """
        # Stable sort: decode rows first, otherwise keep the caller's order.
        order = sorted(range(len(chunks)), key=lambda index: not _decodes(chunks[index]))
        first_token = [0] * len(chunks)  # where each chunk's tokens start in the flat batch
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for index in order:
            chunk = chunks[index]
            first_token[index] = len(token_ids)
            start = chunk.num_computed_tokens
            seq_len = start + len(chunk.token_ids)
            positions.extend(range(start, seq_len))
            token_ids.extend(chunk.token_ids)
            # (query length, sequence length) per attention row
            rows = ([(1, end) for end in range(start + 1, seq_len + 1)] if _decodes(chunk)
                    else [(len(chunk.token_ids), seq_len)])
            for query_len, end in rows:
                query_lens.append(query_len)
                seq_lens.append(end)
        sampling_rows, prompt_rows = _logits_rows(chunks, first_token)
        is_pure_decode = (len(token_ids) == len(chunks) and not prompt_rows
                          and sampling_rows == list(range(len(chunks))))
        plans = tuple(self._plan(chunks, order, group, layout, query_lens, seq_lens)
                      for group, layout in enumerate(self.kv_cache.group_layouts))
        return StepInputs(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            plans=plans,
            logits_indices=torch.tensor(sampling_rows + prompt_rows, dtype=torch.int64,
                                        device=self.device),
            num_sampling_rows=len(sampling_rows),
            is_pure_decode=is_pure_decode,
        )

    def _plan(self, chunks: Sequence[ModelChunk], order: list[int], group: int,
              layout: KVLayout, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        """Group `group`'s attention plan: the batch's rows over its blocks."""
        slot_mapping: list[int] = []
        block_tables: list[Sequence[int]] = []
        for index in order:
            chunk = chunks[index]
            block_ids = chunk.group_block_ids[group]
            start = chunk.num_computed_tokens
            seq_len = start + len(chunk.token_ids)
            slot_mapping.extend(layout.slot_mapping(block_ids, start, seq_len))
            ends = range(start + 1, seq_len + 1) if _decodes(chunk) else (seq_len,)
            block_tables.extend(block_ids[: layout.num_blocks_for_tokens(end)] for end in ends)
        return AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens,
                                       block_tables=block_tables, slot_mapping=slot_mapping,
                                       layout=layout, device=self.device)


def _decodes(chunk: ModelChunk) -> bool:
    """One new token, or one followed only by drafts: its attention rows are decode rows."""
    return len(chunk.token_ids) == 1 + chunk.num_draft_tokens


def _logits_rows(
    chunks: Sequence[ModelChunk], first_token: list[int]
) -> tuple[list[int], list[int]]:
    """Flat-batch rows whose logits the chunks ask for, in the caller's chunk order: the
    sampling rows (each chunk's last token, `num_samples` times, or its last k + 1 tokens with k
    drafts), and the prompt-logprob rows."""
    sampling_rows: list[int] = []
    prompt_rows: list[int] = []
    for chunk, first in zip(chunks, first_token, strict=True):
        last = first + len(chunk.token_ids) - 1
        if chunk.num_draft_tokens:
            sampling_rows.extend(range(last - chunk.num_draft_tokens, last + 1))
        else:
            sampling_rows.extend([last] * chunk.num_samples)
        positions = chunk.prompt_logprob_positions
        if positions:
            start = chunk.num_computed_tokens
            assert start <= positions.start and positions.stop <= start + len(chunk.token_ids)
            offset = first - start
            prompt_rows.extend(range(positions.start + offset, positions.stop + offset))
    return sampling_rows, prompt_rows
