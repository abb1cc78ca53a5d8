"""The `attention` step: the Triton paged decode kernel against SDPA, as a fraction of the
read bandwidth the env step measured (`benchmarks/decode_attention.py` says what is timed).

Llama-3-8B head layout in bf16 at batch 1/64/256 × context 2k/8k, then a tile-configuration
sweep at batch 64 × 8k; one record per shape and per tile configuration, each written as soon
as it is measured, so the step's time limit cuts the sweep first. A smoke run on a machine
without CUDA runs tiny fp32 shapes in Triton's interpreter.
"""

from __future__ import annotations

from benchmarks.gpu.step import StepContext

SMOKE_BATCHES = (1, 3)
SMOKE_CONTEXTS = (40, 64)
SMOKE_SWEEP_SHAPES = ((3, 64),)


def run(ctx: StepContext) -> None:
    from benchmarks import decode_attention

    bandwidth = ctx.read_bandwidth()
    kwargs = _smoke_shapes() if ctx.smoke else {}
    layout = kwargs.get("layout") or decode_attention.AttentionLayout()
    ctx.log.add("layout", **decode_attention.layout_facts(layout), read_bytes_per_s=bandwidth)
    for record, fields in decode_attention.measure(ctx.device, bandwidth, **kwargs):
        ctx.log.add(record, **fields)


def _smoke_shapes() -> dict:
    from benchmarks.decode_attention import AttentionLayout
    from kvpool.memory.kv_layout import KVLayout

    return {"batches": SMOKE_BATCHES, "contexts": SMOKE_CONTEXTS,
            "sweep_shapes": SMOKE_SWEEP_SHAPES,
            "layout": AttentionLayout(8, KVLayout(16, 1, 2, 32, "float32"))}
