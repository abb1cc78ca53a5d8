"""The model runner that replays a captured decode step, and eagerly runs every other step.

A decode step of an 8B Llama launches about 1,200 kernels (docs/cuda_graphs.md), and at small
batches the host's launch time, not the GPU, bounds it. A CUDA graph launches them all as one.

`DecodeGraphRunner.run_step` sends a step to a padded decode (`PaddedDecode`) when it qualifies:
every chunk one new token sampled once (`StepInputs.is_pure_decode`: no prefill, no prompt
logprobs) and at most the largest size of the plan. The step runs as the smallest size that
holds it. Any other step runs eagerly, through `ModelRunner.run_step`, unchanged.

How each size runs is chosen once, at construction (a mapping size -> step):
- `capture`: on CUDA, one `torch.cuda.CUDAGraph` per size, captured largest first into one shared
  memory pool (each capture after an eager run of the same size, which compiles the Triton
  kernels and lets cuBLAS choose its kernels outside the capture), replayed;
- `eager`: the same padded step called directly, for any device: the CPU tests check the
  padding, the static buffers and the fallback with it.

Which engines capture (`decode_plan`): CUDA, the triton attention backend, one process (no
tensor parallelism), not `enforce_eager`, and at least one size to capture.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from kvpool.engine.decode_graphs.padded_decode import DecodePlan, PaddedDecode
from kvpool.engine.model_runner import CausalLM, ModelRunner, StepInputs
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_cache import KVCache

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_CAPTURE_SIZE = 512  # vLLM's cap on its default capture sizes


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """vLLM's pattern, 1, 2, 4, then every 8 to 256, then every 16, up to `max_size`, which
    is added itself so that every batch up to it has a size."""
    pattern = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return tuple(sorted({size for size in pattern if size < max_size} | {max_size}))


def capture_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The decode batch sizes `config` captures: its `cudagraph_capture_sizes`, else the
    default pattern up to `max_cudagraph_capture_size`, both cut at `max_num_seqs` (a decode
    step never holds more sequences)."""
    load, max_num_seqs = config.load, config.scheduling.max_num_seqs
    if load.cudagraph_capture_sizes is not None:
        return tuple(size for size in load.cudagraph_capture_sizes if size <= max_num_seqs)
    limit = load.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE
    return default_capture_sizes(min(limit, max_num_seqs))


def decode_plan(config: EngineConfig, model: torch.nn.Module, device: torch.device,
                max_model_len: int, vocab_size: int) -> DecodePlan | None:
    """The plan of the decode graphs an engine captures; None where it captures none (module
    docstring). Tensor parallelism is the caller's to rule out."""
    backend = getattr(getattr(model, "attention_backend", None), "name", None)
    sizes = capture_sizes(config)
    if config.load.enforce_eager or device.type != "cuda" or backend != "triton" or not sizes:
        return None
    return DecodePlan(sizes, max_model_len, vocab_size)


class DecodeGraphRunner(ModelRunner):
    """A `ModelRunner` whose decode-only steps run padded, each size through `steps`."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device | str,
                 padded: PaddedDecode, steps: Mapping[int, Callable[[], None]]) -> None:
        super().__init__(model, kv_cache, device)
        assert set(steps) == set(padded.plan.batch_sizes), "one step per planned size"
        self.padded = padded
        self.steps = dict(steps)
        self.num_padded_steps = 0  # steps that ran padded (replayed, on CUDA)

    @classmethod
    def eager(cls, model: CausalLM, kv_cache: KVCache, device: torch.device | str,
              plan: DecodePlan) -> DecodeGraphRunner:
        """Padded steps called directly: the graphed path without the graphs, on any device."""
        padded = PaddedDecode(model, kv_cache, plan, torch.device(device))
        steps = {size: functools.partial(padded.run, size) for size in plan.batch_sizes}
        return cls(model, kv_cache, device, padded, steps)

    @classmethod
    def capture(cls, model: CausalLM, kv_cache: KVCache, device: torch.device | str,
                plan: DecodePlan) -> DecodeGraphRunner:
        """One CUDA graph per planned size, captured now (module docstring)."""
        device = torch.device(device)
        padded = PaddedDecode(model, kv_cache, plan, device)
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        graphs: dict[int, torch.cuda.CUDAGraph] = {}
        for size in reversed(plan.batch_sizes):  # largest first: the smaller reuse its memory
            padded.load(None, size)
            padded.run(size)  # compiles and warms outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                padded.run(size)
            graphs[size] = graph
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, %.0f MiB",
                    len(graphs), plan.batch_sizes[0], plan.batch_sizes[-1],
                    time.perf_counter() - start, used / 2**20)
        # A bound `replay` keeps its graph (and the graph its memory) alive with the runner.
        return cls(model, kv_cache, device, padded,
                   {size: graph.replay for size, graph in graphs.items()})

    def run_step(self, block_copies: tuple[BlockCopy, ...],
                 inputs: StepInputs | None) -> torch.Tensor | None:
        """A qualifying step padded to its size (module docstring); any other, eagerly."""
        size = self._padded_size(inputs)
        if size is None:
            return super().run_step(block_copies, inputs)
        assert inputs is not None
        self.kv_cache.copy_blocks(block_copies)
        self.padded.load(inputs, size)
        self.steps[size]()
        self.num_padded_steps += 1
        return self.padded.logits[: inputs.metadata.num_seqs]

    def _padded_size(self, inputs: StepInputs | None) -> int | None:
        if inputs is None or not inputs.is_pure_decode:
            return None
        return self.padded.plan.batch_size_for(inputs.metadata.num_seqs)
