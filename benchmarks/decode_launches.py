"""How many kernels one eager decode step launches, and the host time to issue them, on any machine.

Method: the model (a preset, Llama-3-8B by default, bf16) is built on PyTorch's meta device, where
every op runs its shape logic and no kernel; a `TorchDispatchMode` records each aten op the
forward dispatches. An op that returns a view or only allocates launches nothing; every other
op is counted as one kernel launch, as its CUDA kernel is (a cuBLAS GEMM may add a split-K
reduction: the count is then a lower bound). The attention backend is the Triton backend's
launch plan without its kernels (`LaunchPlanBackend`): per layer the KV write, the decode kernel,
and its reduction when `choose_num_splits` splits the context on `--num-sms` multiprocessors
(132: H100 SXM). Outside the forward, the runner's step preparation copies 7 host lists to the
device, and the sampler runs its own ops: neither is counted here, and a CUDA graph would
capture neither.

The host time: the same layers and ops at toy widths (hidden 64) on the CPU, with the C++ fused
kernels off so every op is the one CUDA runs (`fused.is_served` False) and the attention
launches left out: Python, module calls, the dispatcher and microsecond-sized CPU kernels per
op, per step, on this machine. The driver's launch cost on a GPU comes on top and is not
measured here. Prints a JSON line per case, then a table. From the repository root:

    python -m benchmarks.decode_launches [--preset llama-3-8b] [--num-sms 132]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvpool.attention.metadata import AttentionMetadata
from kvpool.attention.triton_decode import choose_num_splits
from kvpool.kernels import fused
from kvpool.model import presets
from kvpool.model.config import ModelConfig
from kvpool.model.llama import LlamaModel

BLOCK_SIZE = 16
CASES = ((1, 1024), (8, 1024), (64, 2048), (256, 2048))  # (batch, context)
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "detach"}
# Ops whose schema may alias their input (so `is_view`): under inference mode `Tensor.to` and
# `.float()` dispatch as `aten.to`, a conversion kernel whenever the dtype changes.
_MAY_ALIAS = {"to"}


class LaunchPlanBackend:
    """The Triton backend's launches per layer, counted, with no kernel run (module docstring)."""

    name = "triton"

    def __init__(self, num_sms: int) -> None:
        self.num_sms = num_sms
        self.num_launches = 0

    def forward(self, query, key, value, kv_cache_layer, metadata: AttentionMetadata, scale,
                kv_scales=None, sliding_window=None):
        self.num_launches += 1  # write_kv
        num_decode = metadata.num_decode_seqs
        if num_decode:
            num_splits = choose_num_splits(num_decode, kv_cache_layer.shape[3],
                                           metadata.max_decode_seq_len, self.num_sms,
                                           sliding_window=sliding_window)
            self.num_launches += 1 + (num_splits > 1)  # decode, and its reduction
        if num_decode < metadata.num_seqs:
            self.num_launches += 1  # prefill
        return torch.empty_like(query)


class AtenOpCounter(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (not views, not allocations), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _MAY_ALIAS:  # a view when nothing changes, else a copy kernel
            if out is not args[0] and out.dtype != args[0].dtype:
                self.counts[name] += 1
        elif not func.is_view and name not in _ALLOCATIONS:
            self.counts[name] += 1
        return out


@dataclass(frozen=True)
class StepLaunches:
    preset: str
    batch: int
    context: int
    num_layers: int
    aten_kernels: int
    triton_kernels: int
    per_layer: float
    host_ms_toy: float  # the same ops at toy widths on this CPU (module docstring)
    top_ops: dict[str, int]

    @property
    def total(self) -> int:
        return self.aten_kernels + self.triton_kernels


def decode_inputs(config: ModelConfig, batch: int, context: int, device: str):
    """A decode step of `batch` sequences at `context` tokens each, on `device`."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
              for i in range(batch)]
    layout = config.kv_layout(BLOCK_SIZE, torch.bfloat16)
    slots = [table[(context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
             for table in tables]
    metadata = AttentionMetadata.build([1] * batch, [context] * batch, tables, slots, layout,
                                       device=device)
    # No kernel reads it (`LaunchPlanBackend`): the null block and one more will do.
    kv_cache = torch.zeros(layout.tensor_shape(2),
                           dtype=torch.bfloat16, device=device)
    token_ids = torch.zeros(batch, dtype=torch.int64, device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    logits_indices = torch.arange(batch, device=device)
    return token_ids, positions, kv_cache, metadata, logits_indices


def count_step(preset: str, batch: int, context: int, num_sms: int) -> StepLaunches:
    config = presets.preset(preset)
    backend = LaunchPlanBackend(num_sms)
    model = LlamaModel(config, backend, dtype=torch.bfloat16, device="meta")
    inputs = decode_inputs(config, batch, context, "meta")
    with AtenOpCounter() as counter:
        model(*inputs)
    aten = sum(counter.counts.values())
    return StepLaunches(preset, batch, context, config.num_layers, aten, backend.num_launches,
                        (aten + backend.num_launches) / config.num_layers,
                        round(toy_step_ms(config, batch, context), 2),
                        dict(counter.counts.most_common(12)))


def toy_step_ms(config: ModelConfig, batch: int, context: int, repeats: int = 10) -> float:
    """Median ms of the forward at toy widths on the CPU, every op the CUDA path's."""
    toy = dataclasses.replace(config, vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_heads=4, num_kv_heads=2, head_dim=16, bos_token_id=1,
                              eos_token_ids=(2,))
    model = LlamaModel(toy, LaunchPlanBackend(1), dtype=torch.float32)
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.02)
    inputs = decode_inputs(toy, batch, context, "cpu")
    served, num_threads = fused.is_served, torch.get_num_threads()
    fused.is_served = lambda *tensors: False  # the reference ops: what the CUDA path runs
    torch.set_num_threads(1)  # one thread issues a step's ops, as a GPU host thread does
    try:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model(*inputs)
            times.append(time.perf_counter() - start)
    finally:
        fused.is_served = served
        torch.set_num_threads(num_threads)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--num-sms", type=int, default=132)
    args = parser.parse_args()
    results = [count_step(args.preset, batch, context, args.num_sms)
               for batch, context in CASES]
    for result in results:
        print(json.dumps({**asdict(result), "total": result.total}))
    print(f"\n{'batch':>5} {'context':>7} {'aten':>6} {'triton':>6} {'total':>6} "
          f"{'per layer':>9} {'toy CPU ms':>10}")
    for r in results:
        print(f"{r.batch:>5} {r.context:>7} {r.aten_kernels:>6} {r.triton_kernels:>6} "
              f"{r.total:>6} {r.per_layer:>9.1f} {r.host_ms_toy:>10.2f}")


if __name__ == "__main__":
    main()
