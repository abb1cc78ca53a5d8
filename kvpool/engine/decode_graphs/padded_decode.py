"""A decode step padded to a fixed batch size over static input buffers: what a CUDA graph captures.

A CUDA graph replays fixed kernels on fixed addresses with fixed launch arguments, so a graphed
decode reads its inputs from buffers allocated once, sized for the largest captured batch, and
captured size B runs the model on their first B rows. A batch of n <= B decodes is copied into
rows [0, n); rows [n, B) are padding:

    row            0 .. n-1                       n .. B-1
    token_ids      the batch's                    0
    positions      the batch's                    0
    slot_mapping   the batch's                    PAD_SLOT_ID: the Triton write stores nothing
    seq_lens       the batch's                    1: one token, read from the null block
    block_tables   the batch's, null-padded       NULL_BLOCK_ID everywhere
    query_start_loc, logits_indices: 0 .. B, 0 .. B-1 (constant)

A hybrid pool's KV cache groups each have a slot mapping and block tables of their own, padded
the same way; token ids, positions and lengths are shared.

Invariant: a padded step writes KV only at the batch's slots, and padding reads only the null
block (zero, and still zero afterwards: nothing writes it).

What a backend plans on the host is fixed per size, once (`DecodePlan`): B decodes, the longest
context `max_seq_len` (the engine's max_model_len), so the decode kernel's split count is the one
chosen for B at that length on every replay; a shorter context leaves some splits empty, which
the kernel skips. The logits land in a static `[largest size, vocab]` buffer (one for every
size: one graph replays at a time), valid until the next step.

`run(B)` is the function a CUDA graph captures; called directly it is the same step, eagerly,
which is how the CPU tests check it (Triton's interpreter), token for token against the runner.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kvpool.attention.kv_step import KVStep
from kvpool.attention.metadata import PAD_SLOT_ID, AttentionMetadata
from kvpool.engine.model_runner import CausalLM, StepInputs
from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.group_kv_cache import GroupedKVCache
from kvpool.memory.kv_cache import KVCache


@dataclass(frozen=True)
class DecodePlan:
    """What the padded decode serves: its batch sizes (ascending), the longest context of any
    of its sequences, and the vocabulary its logits rows hold."""

    batch_sizes: tuple[int, ...]
    max_seq_len: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"batch sizes must be ascending and distinct: {self.batch_sizes}")
        if self.batch_sizes[0] < 1 or self.max_seq_len < 1:
            raise ValueError("batch sizes and max_seq_len must be at least 1")

    def batch_size_for(self, num_seqs: int) -> int | None:
        """The smallest size that holds `num_seqs` sequences; None above the largest."""
        index = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[index] if index < len(self.batch_sizes) else None


class PaddedDecode:
    """Static inputs and outputs of a decode padded to the plan's sizes (module docstring).
    A hybrid pool's KV cache groups (`kvpool.memory.kv_groups`) each have their slot mapping
    and block tables; the rows, positions and lengths are the same for all."""

    def __init__(self, model: CausalLM, kv_cache: KVCache | GroupedKVCache, plan: DecodePlan,
                 device: torch.device) -> None:
        self.model, self.kv_cache, self.plan = model, kv_cache, plan
        self.layouts = kv_cache.group_layouts
        size = plan.batch_sizes[-1]

        def buffer(fill: int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.token_ids = buffer(0, size, dtype=torch.int64)
        self.positions = buffer(0, size, dtype=torch.int64)
        self.seq_lens = buffer(1, size, dtype=torch.int32)
        self.slot_mappings = [buffer(PAD_SLOT_ID, size, dtype=torch.int64) for _ in self.layouts]
        self.block_tables = [
            buffer(NULL_BLOCK_ID, size, layout.num_blocks_for_tokens(plan.max_seq_len),
                   dtype=torch.int32) for layout in self.layouts]
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(size, dtype=torch.int64, device=device)
        self.logits = buffer(0, size, plan.vocab_size, dtype=torch.float32)
        self.metadata = {batch_size: [self._metadata(batch_size, group)
                                      for group in range(len(self.layouts))]
                         for batch_size in plan.batch_sizes}

    def _metadata(self, batch_size: int, group: int) -> AttentionMetadata:
        """Size `batch_size`'s attention plan for group `group`: views of the static buffers,
        and the plan's host values (every row a decode of at most `max_seq_len` tokens)."""
        max_seq_len = self.plan.max_seq_len
        return AttentionMetadata(
            slot_mapping=self.slot_mappings[group][:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[group][:batch_size],
            query_lens_cpu=(1,) * batch_size,
            seq_lens_cpu=(max_seq_len,) * batch_size,
            query_start_loc_cpu=tuple(range(batch_size + 1)),
            layout=self.layouts[group],
            num_decode_seqs=batch_size,
            max_decode_seq_len=max_seq_len,
            max_prefill_query_len=0,
        )

    @torch.inference_mode()
    def load(self, inputs: StepInputs | None, batch_size: int) -> None:
        """Copy a decode-only step's inputs into rows [0, n) and pad rows [n, batch_size);
        None: all padding (the capture's batch)."""
        num_seqs = 0 if inputs is None else inputs.metadata.num_seqs
        assert num_seqs <= batch_size and batch_size in self.metadata
        assert inputs is None or inputs.is_pure_decode, "only a decode-only step is padded"
        if inputs is not None:
            assert inputs.metadata.max_seq_len <= self.plan.max_seq_len
            self.token_ids[:num_seqs].copy_(inputs.token_ids)
            self.positions[:num_seqs].copy_(inputs.positions)
            self.seq_lens[:num_seqs].copy_(inputs.metadata.seq_lens)
        padding = slice(num_seqs, batch_size)
        self.token_ids[padding] = 0
        self.positions[padding] = 0
        self.seq_lens[padding] = 1
        for group, (slots, tables) in enumerate(zip(self.slot_mappings, self.block_tables,
                                                    strict=True)):
            slots[padding] = PAD_SLOT_ID
            tables[:batch_size] = NULL_BLOCK_ID
            if inputs is not None:
                plan = inputs.plans[group]
                slots[:num_seqs].copy_(plan.slot_mapping)
                tables[:num_seqs, : plan.block_tables.shape[1]].copy_(plan.block_tables)

    @torch.inference_mode()
    def run(self, batch_size: int) -> None:
        """The padded step of `batch_size` rows: logits of every row into `logits[:batch_size]`.
        No host work depends on the batch: this is what a CUDA graph captures."""
        cache = self.kv_cache
        kv = KVStep.build(cache.layer_views, cache.scale_views, self.metadata[batch_size],
                          cache.layer_groups)
        logits = self.model(self.token_ids[:batch_size], self.positions[:batch_size], kv,
                            self.logits_indices[:batch_size])
        self.logits[:batch_size].copy_(logits)
