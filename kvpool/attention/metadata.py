"""What one forward step tells the attention backend about its batch, passed explicitly.

A step runs `num_seqs` sequences at once. Sequence i contributes `query_lens[i]` new tokens,
flattened in order into the step's `[num_tokens]` inputs; after the step its context is
`seq_lens[i]` tokens, the first `seq_lens[i] - query_lens[i]` of which were computed earlier
(prefix-cache hits or earlier steps / prefill chunks) and already sit in the KV cache.

    flattened query:  | s0: 1 | s1: 1 | s2: 5 tokens            | s3: 3 tokens    |
    query_start_loc:  0       1       2                          7                 10
    seq 2 context:    [ 11 cached tokens ......... | 5 new ]     seq_lens[2] = 16

Decode and prefill mix freely: a decode is simply a sequence with query_len 1. The engine puts
sequences with query_len 1 first, and `num_decode_seqs` counts them, so a backend with separate
decode and prefill kernels launches each once. New token j of sequence i sits at absolute
position `seq_lens[i] - query_lens[i] + j` and attends causally to positions 0..that position.

Invariants: `query_start_loc[0] == 0`, `query_start_loc[-1] == num_tokens`,
`1 <= query_lens[i] <= seq_lens[i]`, `block_tables[i]` holds at least
`layout.num_blocks_for_tokens(seq_lens[i])` valid ids, padded after them with the null block
(`NULL_BLOCK_ID`, whose KV is zero: a read past the end never sees another request's KV), and
`slot_mapping` has one slot per new token, in the same flattened order. Block size and every
other fact about the KV cache come from `layout`, the engine's one `KVLayout`.

Padding (graphed decode only, `kvpool.engine.decode_graphs`): a batch padded to a captured
size ends in rows whose slot is `PAD_SLOT_ID` (the Triton write stores nothing for it), whose
context is 1 token and whose block table is all null block: they read the null block's zeros
and write nothing, so the null block stays zero. There, the host values are the capture's plan
(`max_decode_seq_len` the longest context the graph serves), not the batch's.

This is the step's attention plan: the model runner builds it once per step
(`ModelRunner.prepare`) and every layer's backend call reads it. What backends plan on the host
is in it as host values (`query_start_loc_cpu`, `max_decode_seq_len`, `max_prefill_query_len`),
so no layer reads a tensor back or re-derives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.kv_layout import KVLayout

PAD_SLOT_ID = -1  # the slot of a padded token: its K/V are written nowhere


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of query_lens
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, null-block padded
    query_lens_cpu: tuple[int, ...]  # host copies, for backends that plan on the CPU
    seq_lens_cpu: tuple[int, ...]
    query_start_loc_cpu: tuple[int, ...]
    layout: KVLayout
    num_decode_seqs: int  # the first num_decode_seqs sequences have query_len == 1
    max_decode_seq_len: int  # the longest context among the decodes (0: none)
    max_prefill_query_len: int  # the most new tokens among the rest (0: none)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        layout: KVLayout,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build device tensors from per-sequence Python lists (one host→device copy each)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per sequence"
            )
        for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
            if not 1 <= query_len <= seq_len:
                raise ValueError(f"need 1 <= query_len <= seq_len, got {query_len} and {seq_len}")
        if sum(query_lens) != len(slot_mapping):
            raise ValueError("slot_mapping needs one slot per new token")
        num_decode_seqs = 0
        while num_decode_seqs < len(query_lens) and query_lens[num_decode_seqs] == 1:
            num_decode_seqs += 1
        max_num_blocks = max((len(table) for table in block_tables), default=0)
        padded = [
            list(table) + [NULL_BLOCK_ID] * (max_num_blocks - len(table)) for table in block_tables
        ]
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(block_tables), max_num_blocks
            ),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
            query_start_loc_cpu=tuple(starts),
            layout=layout,
            num_decode_seqs=num_decode_seqs,
            max_decode_seq_len=max(seq_lens[:num_decode_seqs], default=0),
            max_prefill_query_len=max(query_lens[num_decode_seqs:], default=0),
        )
