"""The Triton `AttentionBackend`: three launches per layer and step, whatever the batch mix.

1. `write_kv_triton` (`kvpool.attention.kv_write`) stores the step's new K/V into their slots;
2. `paged_decode` attends for the first `metadata.num_decode_seqs` sequences (query_len 1),
   split along the context when the batch alone cannot fill the GPU;
3. `paged_prefill` attends for the rest (prefill and chunked-prefill / extend sequences), over
   their cached prefix and their new tokens.

A quantized cache (int8 / fp8, `kv_scales` given) flows through all three: the write quantizes
the new rows and stores their scales, and both attention kernels dequantize K/V tiles in
registers (`triton_tiles.load_kv_tile`).

All planning uses the host copies in the metadata (`seq_lens_cpu`, `query_lens_cpu`), so a step
never waits on the device.

No kernel compiles mid-request. Triton compiles a kernel variant per distinct set of
constexprs and specialisations, so the kernels do not specialise on what changes between steps
(`do_not_specialize`: split counts, block-table widths, the prefill's first row), and the
backend's first call launches every variant a later call can: decode unsplit and split (with
its reduction) and prefill, on the null block, with the call's own query, cache and dtypes.
That first call is the engine's start-up warm-up (`kvpool.engine.warmup`), on every rank.
A sliding window (`sliding_window`) is a runtime scalar of both attention kernels, not a
specialisation, so the variants the warm-up compiles serve every layer's window (or none).
A soft-cap (`logit_softcap`) is a property of the whole model, so whether there is one is a
constexpr: the variants are compiled per kind of call, capped or not, at the first call of that
kind, which for a model is the warm-up (every layer of a capped model is capped).
"""

from __future__ import annotations

import torch

from kvpool.attention.backend import check_logit_softcap, check_sliding_window
from kvpool.attention.kv_write import write_kv_triton
from kvpool.attention.metadata import AttentionMetadata
from kvpool.attention.triton_decode import DecodeConfig, paged_decode
from kvpool.attention.triton_prefill import PrefillConfig, paged_prefill
from kvpool.memory.block_pool import NULL_BLOCK_ID


class TritonAttentionBackend:
    """Paged attention through Triton kernels (CUDA; or CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(
        self, decode_config: DecodeConfig | None = None, prefill_config: PrefillConfig | None = None
    ) -> None:
        self.decode_config = decode_config or DecodeConfig()
        self.prefill_config = prefill_config or PrefillConfig()
        self._compiled: set[tuple] = set()  # what `_compile_variants` ran for

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads]
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        check_sliding_window(sliding_window)
        check_logit_softcap(logit_softcap)
        self._compile_variants(query, kv_cache_layer, kv_scales, logit_softcap)
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
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        if num_decode < metadata.num_seqs:
            paged_prefill(
                query,
                kv_cache_layer,
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.block_tables,
                scale,
                max_query_len=metadata.max_prefill_query_len,
                out=output,
                config=self.prefill_config,
                kv_scales=kv_scales,
                first_seq=num_decode,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        return output

    def _compile_variants(self, query: torch.Tensor, kv_cache_layer: torch.Tensor,
                          kv_scales: torch.Tensor | None, logit_softcap: float | None) -> None:
        """Once per query/cache kind, capped or not: launch each attention kernel variant a
        step can use, so that Triton compiles them all now. One-token sequences over the null
        block (zero, only read), outputs into scratch tensors; the KV write compiles in the
        same call."""
        kind = (query.dtype, query.shape[1:], query.stride(), kv_cache_layer.dtype,
                kv_cache_layer.shape[1:], kv_cache_layer.stride(), query.device,
                logit_softcap is not None)
        if kind in self._compiled or query.shape[0] == 0:
            return
        self._compiled.add(kind)
        one_query = query[:1]  # the call's own strides and alignment
        table = torch.full((1, 1), NULL_BLOCK_ID, dtype=torch.int32, device=query.device)
        seq_lens = torch.ones(1, dtype=torch.int32, device=query.device)
        for num_splits in (1, 2):
            paged_decode(one_query, kv_cache_layer, table, seq_lens, 1.0, max_seq_len=1,
                         out=torch.empty_like(one_query), num_splits=num_splits,
                         config=self.decode_config, kv_scales=kv_scales,
                         logit_softcap=logit_softcap)
        starts = torch.tensor([0, 1], dtype=torch.int32, device=query.device)
        paged_prefill(one_query, kv_cache_layer, starts, seq_lens, table, 1.0, max_query_len=1,
                      out=torch.empty_like(one_query), config=self.prefill_config,
                      kv_scales=kv_scales, logit_softcap=logit_softcap)
