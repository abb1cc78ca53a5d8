"""`kvpool bench kv-granularity`: which scale granularity quantized KV should use, measured.

The held-out text (`kvpool.bench.heldout_text`) is scored as one prefill through the model with
a float KV cache, its K and V rounded on their way into the cache ("fake" quantization: codes
dequantized at once, so the attention that follows reads exactly what a quantized cache would
hold), for int8 and fp8 e4m3 and two granularities:

- per token: one scale per (token, KV head), what kvpool stores (`kvpool.memory.kv_quant`);
- per block: one scale per (block, KV head), here with hindsight: all of a block's tokens are
  in the one prefill, so each block's scale comes from its final amax. That is the best a
  per-block scale can do; during decode a block fills a token at a time and its scale would
  have to be fixed early (clipping later tokens) or recomputed (rewriting shared blocks).

Reported: perplexity and its change against the unrounded cache. Bytes per token are the
layout's: a per-block scale would save the per-token scale's 4 bytes per 64-byte row.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from kvpool.bench.heldout_text import TEXT
from kvpool.bench.precision import KV_CACHE_MEMORY, teacher_forced
from kvpool.memory.kv_quant import dequantize, encode, scales_for

DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
GRANULARITIES = ("token", "block")


def fake_quantize(rows: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                  dtype: torch.dtype, granularity: str) -> torch.Tensor:
    """`rows` [num_tokens, num_kv_heads, head_dim] rounded through `dtype` codes, with one
    scale per (token, head) or per (block, head) over the rows of each block given."""
    amax = rows.float().abs().amax(dim=-1)  # [num_tokens, num_kv_heads]
    if granularity == "block":
        blocks, row_block = torch.unique(slot_mapping // block_size, return_inverse=True)
        index = row_block[:, None].expand_as(amax)
        block_amax = amax.new_zeros((len(blocks), amax.shape[1]))
        block_amax.scatter_reduce_(0, index, amax, reduce="amax")
        amax = block_amax[row_block]
    codes, scales = encode(rows, scales_for(amax, dtype), dtype)
    return dequantize(codes, scales, rows.dtype)


class FakeQuantBackend:
    """An attention backend that rounds the new K/V as a quantized cache would, then hands
    everything to the backend it wraps."""

    def __init__(self, inner, dtype: torch.dtype, granularity: str) -> None:
        self.inner, self.dtype, self.granularity = inner, dtype, granularity
        self.name = f"fake-{granularity}-{dtype}"

    def forward(self, query, key, value, kv_cache_layer, metadata, scale, kv_scales=None,
                sliding_window=None, logit_softcap=None):
        block_size, slots = metadata.layout.block_size, metadata.slot_mapping
        key = fake_quantize(key, slots, block_size, self.dtype, self.granularity)
        value = fake_quantize(value, slots, block_size, self.dtype, self.granularity)
        return self.inner.forward(query, key, value, kv_cache_layer, metadata, scale, kv_scales,
                                  sliding_window, logit_softcap)


def _perplexity(llm, token_ids: list[int]) -> float:
    logprobs, _ = teacher_forced(llm.engine, token_ids)
    return math.exp(-statistics.fmean(logprobs))


def run_granularity(model: str | None, text_tokens: int | None = None) -> dict:
    """Perplexity with the float cache, then each (dtype, granularity) rounding of it."""
    from kvpool.engine.llm import LLM

    llm = LLM(model, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, enable_warmup=False)
    token_ids = llm.get_tokenizer().encode(TEXT)[:text_tokens]
    attentions = [layer.self_attn for layer in llm.engine.runner.model.layers]
    inner = attentions[0].backend
    reference = _perplexity(llm, token_ids)
    rows = {}
    for name, dtype in DTYPES.items():
        for granularity in GRANULARITIES:
            for attention in attentions:
                attention.backend = FakeQuantBackend(inner, dtype, granularity)
            perplexity = _perplexity(llm, token_ids)
            rows[f"{name}/{granularity}"] = {
                "perplexity": perplexity, "relative_difference": perplexity / reference - 1}
    for attention in attentions:
        attention.backend = inner
    return {"num_tokens": len(token_ids), "reference_perplexity": reference, "runs": rows}


def format_granularity(result: dict) -> str:
    lines = [f"perplexity of a {result['num_tokens']}-token held-out text, float32 model, "
             f"K/V rounded through each code (block scales with hindsight)",
             f"  {'float32 KV (reference)':<24} {result['reference_perplexity']:.4f}"]
    for name, row in result["runs"].items():
        dtype, granularity = name.split("/")
        label = f"{dtype}, per {granularity}"
        lines.append(f"  {label:<24} {row['perplexity']:.4f}  "
                     f"{row['relative_difference']:+.3%}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The benchmark of `kvpool bench kv-granularity` (flags: kvpool.cli.bench)."""
    result = run_granularity(args.model, args.text_tokens)
    print(json.dumps(result) if args.json else format_granularity(result))
    return 0
