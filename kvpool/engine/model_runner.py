"""Turns one scheduled step into tensors, runs the model, and returns the logits it asked for.

The scheduler speaks in sequences and block tables; the model speaks in flat token ids,
positions and `AttentionMetadata`. The runner translates: it orders the step's chunks decode
first (so backends can launch one kernel per kind), flattens their tokens, computes each new
token's slot from its block table, and maps the logits back to the caller's chunk order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpool.attention.metadata import AttentionMetadata
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """One sequence's share of a step: `token_ids` are new this step and follow
    `num_computed_tokens` tokens whose KV is already cached in `block_ids`."""

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]
    needs_logits: bool = True

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)


class CausalLM(Protocol):
    def __call__(
        self,
        token_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] int64
    ) -> torch.Tensor:  # [num_logits, vocab_size] float32
        ...


@dataclass(frozen=True, slots=True)
class StepInputs:
    token_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    logits_order: list[int]  # logits row r belongs to the r-th chunk (caller order) needing logits


class ModelRunner:
    """Runs a `CausalLM` over a `KVCache`, one step at a time."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device | str = "cpu"):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(
        self, chunks: Sequence[SequenceChunk], block_copies: Sequence[BlockCopy] = ()
    ) -> torch.Tensor:
        """Apply pending block copies, run the step, return `[num_needing_logits, vocab]` logits
        in the order the chunks were given."""
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
        )
        if inputs.logits_order == sorted(inputs.logits_order):
            return logits
        restore = torch.empty(len(inputs.logits_order), dtype=torch.int64)
        restore[torch.tensor(inputs.logits_order)] = torch.arange(len(inputs.logits_order))
        return logits[restore.to(logits.device)]

    def prepare(self, chunks: Sequence[SequenceChunk]) -> StepInputs:
        """Flatten the chunks (decodes first) into the model's inputs."""
        block_size = self.kv_cache.block_size
        # Stable sort: decodes (one new token) first, otherwise keep the caller's order.
        order = sorted(range(len(chunks)), key=lambda index: len(chunks[index].token_ids) != 1)
        needing_logits = [index for index, chunk in enumerate(chunks) if chunk.needs_logits]
        rank_of_chunk = {index: rank for rank, index in enumerate(needing_logits)}
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        logits_order: list[int] = []
        for index in order:
            chunk = chunks[index]
            start = chunk.num_computed_tokens
            positions.extend(range(start, chunk.seq_len))
            slot_mapping.extend(
                chunk.block_ids[p // block_size] * block_size + p % block_size
                for p in range(start, chunk.seq_len)
            )
            token_ids.extend(chunk.token_ids)
            if chunk.needs_logits:
                logits_indices.append(len(token_ids) - 1)
                logits_order.append(rank_of_chunk[index])
        ordered = [chunks[index] for index in order]
        metadata = AttentionMetadata.build(
            query_lens=[len(chunk.token_ids) for chunk in ordered],
            seq_lens=[chunk.seq_len for chunk in ordered],
            block_tables=[chunk.block_ids[: -(-chunk.seq_len // block_size)] for chunk in ordered],
            slot_mapping=slot_mapping,
            block_size=block_size,
            device=self.device,
        )
        return StepInputs(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            logits_order=logits_order,
        )
