"""The Triton `AttentionBackend`: three launches per layer and step, whatever the batch mix.

1. `write_kv_triton` (`kvpool.attention.kv_write`) stores the step's new K/V into their slots;
2. `paged_decode` attends for the first `metadata.num_decode_seqs` sequences (query_len 1),
   split along the context when the batch alone cannot fill the GPU;
3. `paged_prefill` attends for the rest (prefill and chunked-prefill / extend sequences), over
   their cached prefix and their new tokens.

A quantized cache (int8 / fp8, `kv_scales` given) flows through all three: the write quantizes
the new rows and stores their scales, and both attention kernels dequantize K/V tiles in
registers (`triton_decode.load_kv_tile`).

All planning uses the host copies in the metadata (`seq_lens_cpu`, `query_lens_cpu`), so a step
never waits on the device.
"""

from __future__ import annotations

import torch

from kvpool.attention.kv_write import write_kv_triton
from kvpool.attention.metadata import AttentionMetadata
from kvpool.attention.triton_decode import DecodeConfig, paged_decode
from kvpool.attention.triton_prefill import PrefillConfig, paged_prefill


class TritonAttentionBackend:
    """Paged attention through Triton kernels (CUDA; or CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(
        self, decode_config: DecodeConfig | None = None, prefill_config: PrefillConfig | None = None
    ) -> None:
        self.decode_config = decode_config or DecodeConfig()
        self.prefill_config = prefill_config or PrefillConfig()

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        write_kv_triton(kv_cache_layer, key, value, metadata.slot_mapping, kv_scales)
        output = torch.empty_like(query)
        num_decode = metadata.num_decode_seqs
        if num_decode:
            # Decode tokens come first, one per sequence: rows [0, num_decode) of the query.
            paged_decode(
                query[:num_decode],
                kv_cache_layer,
                metadata.block_tables[:num_decode],
                metadata.seq_lens[:num_decode],
                scale,
                max_seq_len=metadata.max_decode_seq_len,
                out=output[:num_decode],
                config=self.decode_config,
                kv_scales=kv_scales,
            )
        if num_decode < metadata.num_seqs:
            paged_prefill(
                query,
                kv_cache_layer,
                metadata.query_start_loc[num_decode:],
                metadata.seq_lens[num_decode:],
                metadata.block_tables[num_decode:],
                scale,
                max_query_len=metadata.max_prefill_query_len,
                out=output,
                config=self.prefill_config,
                kv_scales=kv_scales,
            )
        return output
