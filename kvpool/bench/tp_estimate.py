"""A paper estimate of tensor-parallel decode on H200-class GPUs: per decode step, the HBM time
every GPU needs for its share of the weights and KV, and the NVLink time of the step's
collectives. No GPU, no process group: arithmetic from the model's shape and published figures.

Per decode step at batch B (one new token per sequence) and context C tokens, tp = n GPUs:

    HBM bound      (weight bytes / n  +  B × C × KV bytes per token × local KV heads / KV heads)
                   ÷ HBM bandwidth
    all-reduces    2 × num_layers + 1 calls (o_proj and down per layer, the vocab-parallel
                   embedding), each of B × hidden × dtype bytes; a ring all-reduce moves
                   2(n-1)/n × message bytes through each GPU: time = that ÷ bus bandwidth
                   + per-call latency
    LM-head gather one call: rank 0 receives (n-1)/n of B × vocab × dtype bytes
    share          collective time ÷ (HBM bound + collective time): nothing overlapped

Weights are `kvpool.bench.roofline.weight_bytes_read_per_step` (the embedding table only for
its rows unless tied), all divided by n (the replicated norms, < 0.01% of them, included). KV
heads follow `TensorParallel.num_local_kv_heads`: with fewer KV heads than GPUs each GPU keeps
one (replicated), so KV bytes per GPU stop shrinking at n = num_kv_heads.

Figures and where they come from (the one place this repo states them):
- H200 HBM3e: 141 GB at 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet).
- NVLink 4: 18 links × 50 GB/s = 900 GB/s per GPU both directions, 450 GB/s each way (NVIDIA
  H100/H200 datasheets, "NVLink: 900GB/s").
- Achieved bus bandwidth 370 GB/s: NCCL's maintainer on NVLink 4, "450GB/s is the line rate.
  With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s"
  (github.com/NVIDIA/nccl-tests/issues/212); "bus bandwidth" as nccl-tests defines it
  (doc/PERFORMANCE.md: busbw = algbw × 2(n-1)/n for all-reduce), so a ring all-reduce of M
  bytes takes 2(n-1)/n × M / busbw. NVLink SHARP reaches ~480 GB/s busbw at large messages;
  decode messages are small, so the ring figure is used.
- Per-collective latency 10 µs: an assumption for small NCCL all-reduces inside one NVLink node
  (nccl-tests small-message times are of this order; vLLM's custom all-reduce exists because
  NCCL's are not lower). Decode messages (B × hidden × 2 bytes: 8 KiB to 1 MiB) are
  latency-bound, so this figure dominates the collective time at small batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvpool.model import presets
from kvpool.model.config import ModelConfig
from kvpool.model.parallel import TensorParallel, check_shapes

# Llama-2-70B, from meta-llama/Llama-2-70b-hf's config.json (no preset: no test needs its
# weights). Shape fields only matter here.
LLAMA_2_70B = ModelConfig(
    architecture="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
    num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
)
ESTIMATE_MODELS: dict[str, ModelConfig] = {
    "llama-3-8b": presets.preset("llama-3-8b"),
    "llama-2-70b": LLAMA_2_70B,
}
DEFAULT_TP_SIZES = (1, 2, 4, 8)
DEFAULT_BATCHES = (1, 64)
DEFAULT_CONTEXT = 2048


@dataclass(frozen=True, slots=True)
class Hardware:
    """One GPU of an NVLink node: the figures the estimate divides by (sources above)."""

    name: str = "H200 SXM"
    memory_bytes: float = 141e9
    hbm_bytes_per_s: float = 4.8e12
    nvlink_bytes_per_s_per_direction: float = 450e9
    bus_bytes_per_s: float = 370e9  # achieved NCCL ring bus bandwidth
    collective_latency_s: float = 10e-6


H200 = Hardware()


def all_reduce_seconds(message_bytes: float, tp_size: int, hardware: Hardware) -> float:
    """One ring all-reduce of `message_bytes` over `tp_size` GPUs (none at size 1)."""
    if tp_size == 1:
        return 0.0
    moved = 2 * (tp_size - 1) / tp_size * message_bytes
    return moved / hardware.bus_bytes_per_s + hardware.collective_latency_s


def gather_seconds(total_bytes: float, tp_size: int, hardware: Hardware) -> float:
    """Rank 0 receiving the other ranks' (n-1)/n of `total_bytes` (none at size 1)."""
    if tp_size == 1:
        return 0.0
    moved = (tp_size - 1) / tp_size * total_bytes
    return moved / hardware.bus_bytes_per_s + hardware.collective_latency_s


def decode_step_estimate(config: ModelConfig, tp_size: int, batch: int, context: int,
                         dtype: torch.dtype = torch.bfloat16,
                         hardware: Hardware = H200) -> dict:
    """Per-GPU bytes and times of one decode step (module docstring's formulas)."""
    from kvpool.bench.roofline import weight_bytes_read_per_step

    check_shapes(config, tp_size)
    element_size = torch.empty((), dtype=dtype).element_size()
    local_kv_heads = TensorParallel(0, tp_size).num_local_kv_heads(config.num_kv_heads)
    kv_per_token = config.kv_layout(1, dtype).bytes_per_token
    weight_bytes = weight_bytes_read_per_step(config, dtype) / tp_size
    kv_bytes = batch * context * kv_per_token * local_kv_heads / config.num_kv_heads
    hbm_s = (weight_bytes + kv_bytes) / hardware.hbm_bytes_per_s
    num_all_reduces = 2 * config.num_layers + 1 if tp_size > 1 else 0
    message_bytes = batch * config.hidden_size * element_size
    all_reduce_s = num_all_reduces * all_reduce_seconds(message_bytes, tp_size, hardware)
    gather_s = gather_seconds(batch * config.vocab_size * element_size, tp_size, hardware)
    collective_s = all_reduce_s + gather_s
    return {
        "tp_size": tp_size, "batch": batch, "context": context,
        "weight_bytes_per_gpu": weight_bytes, "kv_bytes_per_gpu": kv_bytes,
        "fits": weight_bytes + kv_bytes <= hardware.memory_bytes,
        "hbm_ms": hbm_s * 1e3, "num_collectives": num_all_reduces + (tp_size > 1),
        "all_reduce_message_bytes": message_bytes, "all_reduce_ms": all_reduce_s * 1e3,
        "gather_ms": gather_s * 1e3, "collective_ms": collective_s * 1e3,
        "step_ms": (hbm_s + collective_s) * 1e3,
        "collective_share": collective_s / (hbm_s + collective_s),
    }


def estimate_report(models: dict[str, ModelConfig] | None = None,
                    tp_sizes: tuple[int, ...] = DEFAULT_TP_SIZES,
                    batches: tuple[int, ...] = DEFAULT_BATCHES, context: int = DEFAULT_CONTEXT,
                    hardware: Hardware = H200) -> dict:
    """Every (model, tp, batch) decode-step estimate, in bf16, with the figures used."""
    models = ESTIMATE_MODELS if models is None else models
    rows = [{"model": name, **decode_step_estimate(config, tp, batch, context,
                                                   hardware=hardware)}
            for name, config in models.items() for batch in batches for tp in tp_sizes]
    return {"hardware": asdict(hardware), "dtype": "bfloat16", "context": context,
            "rows": rows}


def format_estimate(report: dict) -> str:
    """The estimate as a table (per GPU, per decode step)."""
    hardware = report["hardware"]
    lines = [f"paper estimate: one decode step on {hardware['name']} "
             f"(HBM {hardware['hbm_bytes_per_s'] / 1e12:.1f} TB/s, NVLink busbw "
             f"{hardware['bus_bytes_per_s'] / 1e9:.0f} GB/s, "
             f"{hardware['collective_latency_s'] * 1e6:.0f} us per collective), "
             f"{report['dtype']}, context {report['context']}",
             f"  {'model':<12} {'batch':>5} {'tp':>3} {'weights GB':>10} {'KV GB':>7} "
             f"{'fits':>4} {'HBM ms':>7} {'calls':>5} {'coll ms':>7} {'step ms':>7} "
             f"{'coll %':>6}"]
    for row in report["rows"]:
        lines.append(
            f"  {row['model']:<12} {row['batch']:>5} {row['tp_size']:>3} "
            f"{row['weight_bytes_per_gpu'] / 1e9:>10.2f} {row['kv_bytes_per_gpu'] / 1e9:>7.2f} "
            f"{'yes' if row['fits'] else 'no':>4} {row['hbm_ms']:>7.3f} "
            f"{row['num_collectives']:>5} {row['collective_ms']:>7.3f} {row['step_ms']:>7.3f} "
            f"{row['collective_share']:>6.1%}")
    return "\n".join(lines)
