"""Turns one scheduled step into tensors, runs the model, and returns the logits it asked for.

The scheduler speaks in sequences and block tables; the model speaks in flat token ids,
positions and `AttentionMetadata`. The runner translates: it orders the step's chunks decode
first (so backends can launch one kernel per kind), flattens their tokens, computes each new
token's slot from its block table (`KVLayout.slot_mapping`), and maps the logits back to the
caller's chunk order. A chunk asks for `num_samples` logits rows of its last token: 0 mid-prompt,
usually 1, n where a prompt's last chunk is sampled once per completion to be forked, so the
sampler gets exactly one row per sequence and nothing is re-indexed after the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpool.attention.metadata import AttentionMetadata
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_cache import KVCache


class ModelChunk(Protocol):
    """One sequence's share of a step: `token_ids` are new this step and follow
    `num_computed_tokens` tokens whose KV is already cached in `block_ids`; the step returns
    `num_samples` logits rows of its last token. The scheduler's `ScheduledChunk` is one."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int]: ...

    @property
    def num_samples(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """A plain `ModelChunk` (for callers without a scheduler: tests, tools)."""

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]
    num_samples: int = 1


class CausalLM(Protocol):
    def __call__(
        self,
        token_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] int64
        kv_scales: torch.Tensor | None = None,  # int8/fp8 KV: the KVCache's scale pool
    ) -> torch.Tensor:  # [num_logits, vocab_size] float32
        ...


@dataclass(frozen=True, slots=True)
class StepInputs:
    token_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    logits_order: list[int]  # logits row r is the r-th row in caller order (see `execute`)


class ModelRunner:
    """Runs a `CausalLM` over a `KVCache`, one step at a time."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device | str = "cpu"):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(
        self, chunks: Sequence[ModelChunk], block_copies: Sequence[BlockCopy] = ()
    ) -> torch.Tensor:
        """Apply pending block copies, run the step, return `[sum of num_samples, vocab]`
        logits: each chunk's rows in turn, in the order the chunks were given."""
        self.kv_cache.copy_blocks(block_copies)
        if not chunks:
            return torch.empty(0, device=self.device)
        inputs = self.prepare(chunks)
        logits = self.model(
            inputs.token_ids,
            inputs.positions,
            self.kv_cache.tensor,
            inputs.metadata,
            inputs.logits_indices,
            self.kv_cache.scales,
        )
        if inputs.logits_order == sorted(inputs.logits_order):
            return logits
        restore = torch.empty(len(inputs.logits_order), dtype=torch.int64)
        restore[torch.tensor(inputs.logits_order)] = torch.arange(len(inputs.logits_order))
        return logits[restore.to(logits.device)]

    def prepare(self, chunks: Sequence[ModelChunk]) -> StepInputs:
        """Flatten the chunks (decodes first) into the model's inputs."""
        layout = self.kv_cache.layout
        # Stable sort: decodes (one new token) first, otherwise keep the caller's order.
        order = sorted(range(len(chunks)), key=lambda index: len(chunks[index].token_ids) != 1)
        first_row: list[int] = []  # the caller-order logits row of each chunk's first sample
        num_rows = 0
        for chunk in chunks:
            first_row.append(num_rows)
            num_rows += chunk.num_samples
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        logits_order: list[int] = []
        seq_lens: list[int] = []
        for index in order:
            chunk = chunks[index]
            start = chunk.num_computed_tokens
            seq_len = start + len(chunk.token_ids)
            seq_lens.append(seq_len)
            positions.extend(range(start, seq_len))
            slot_mapping.extend(layout.slot_mapping(chunk.block_ids, start, seq_len))
            token_ids.extend(chunk.token_ids)
            logits_indices.extend([len(token_ids) - 1] * chunk.num_samples)
            logits_order.extend(range(first_row[index], first_row[index] + chunk.num_samples))
        ordered = [chunks[index] for index in order]
        metadata = AttentionMetadata.build(
            query_lens=[len(chunk.token_ids) for chunk in ordered],
            seq_lens=seq_lens,
            block_tables=[chunk.block_ids[: layout.num_blocks_for_tokens(seq_len)]
                          for chunk, seq_len in zip(ordered, seq_lens, strict=True)],
            slot_mapping=slot_mapping,
            layout=layout,
            device=self.device,
        )
        return StepInputs(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            logits_order=logits_order,
        )
