"""Engine start-up: load the model (`kvpool.engine.model_loading`), size the KV budget,
reserve it once, build the pool.

Sizing rule, first match wins:
1. `num_gpu_blocks`: exactly that many blocks;
2. `kv_cache_memory`: that many bytes of KV;
3. on CUDA: `gpu_memory_utilization` × device memory, minus what the process already holds
   after loading the weights, minus a reserve for a step's activations;
4. on the CPU: 2 GiB.

The model's sampling defaults are decided here too: the sampling fields of its generation
config (`config.load.generation_config`, "auto" by default, and `override_generation_config`; see
`kvpool.engine.generation_config`), checked once as `SamplingParams`.

The model's dtype is decided here, once: `config.load.dtype` ("auto" by default) becomes a torch
dtype for the device (`kvpool.model.dtype.resolve_dtype`); the KV cache takes the model's,
unless `kv_cache_dtype` names another (int8 and fp8 add a scale pool: `kvpool.memory.kv_quant`).
The KV layout (`KVLayout`: block size, shape, dtype, bytes per block) is decided here, once,
and handed to everything that needs it. The budget is reserved as ONE arena buffer by
`KVMemory`, holding the usable blocks plus the null block, and the KV cache is carved from it:
in static mode one exact allocation of every block (the KV tensor a view of it); in elastic
mode segments, taken and given back as the load changes (`kvpool.memory.elastic_pool`).

Working buffers (a step's activations, logits, attention metadata) are *not* taken from the
arena: they are short-lived tensors of varying shape that torch's caching allocator already
recycles without device calls, and taking them from the arena would mean threading
preallocated outputs through every model layer. On CUDA the activation reserve above leaves
them room; the arena holds KV blocks and nothing else, so every arena byte is a potential block.

With `tensor_parallel_size` > 1 (`kvpool.engine.parallel`) the model's shapes are checked
first, then the workers start, and this process builds rank 0's parts: its model shard and a
KV cache of its local KV heads, sized as above; the workers are told that layout and block
count, so every rank holds the same block ids. The parts then carry the `WorkerGroup`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.engine.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    CacheConfig,
    EngineConfig,
    LoadConfig,
    TierConfig,
)
from kvpool.engine.cpu_threads import FixedThreads, ThreadPolicy, thread_policy
from kvpool.engine.decode_graphs import DecodeGraphRunner, decode_plan
from kvpool.engine.generation_config import default_sampling_params
from kvpool.engine.model_loading import load_engine_model, resolve_device
from kvpool.engine.model_runner import ModelRunner
from kvpool.engine.parallel import TensorParallelRunner, WorkerGroup
from kvpool.engine.parallel.group import rank_device
from kvpool.engine.parallel.messages import KVSpec
from kvpool.engine.sampling_params import SamplingParams
from kvpool.memory.elastic_pool import ElasticPoolConfig
from kvpool.memory.hybrid_memory import HybridKVMemory
from kvpool.memory.kv_groups import KVGroup, kv_groups
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.tiers.disk_tier import DiskKVTier
from kvpool.memory.tiers.host_tier import HostKVTier
from kvpool.memory.tiers.lower_tier import LowerTier
from kvpool.memory.tiers.redis_tier import RedisKVTier
from kvpool.model.config import ModelConfig
from kvpool.model.dtype import AUTO, resolve_dtype
from kvpool.model.loaders.auto import make_loader
from kvpool.model.loaders.base import LoadedModel
from kvpool.model.loaders.hub import resolve_model_path
from kvpool.model.parallel import TensorParallel, check_shapes
from kvpool.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Room for one step's activations and logits when the KV budget comes from the device's size.
ACTIVATION_RESERVE_BYTES = 1024**3


@dataclass(frozen=True)
class EngineParts:
    model_config: ModelConfig
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype  # the model's and its KV cache's: "auto" resolved
    max_model_len: int
    kv_memory: KVMemory | HybridKVMemory
    # SamplingParams field -> value for the fields the model's generation config sets
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    workers: WorkerGroup | None = None  # the other ranks, with tensor_parallel_size > 1
    # The model's CPU thread count, step by step (`kvpool.engine.cpu_threads`)
    cpu_threads: ThreadPolicy = field(default_factory=FixedThreads)


def build_engine_parts(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Everything an engine runs on; pass `loaded` to reuse a model already in memory (its
    dtype is the engine's: `config.load.dtype` "auto" takes it, an explicit one must match it).
    With tensor_parallel_size > 1 the workers start too (and `loaded` must be None)."""
    if config.parallel.tensor_parallel_size > 1:
        return _build_parallel_parts(config, loaded)
    device = resolve_device(config.load.device)
    threads = thread_policy(config.load.cpu_threads, device)  # a fixed count: before loading
    parts = _assemble_parts(config, loaded or load_engine_model(config), device,
                            TensorParallel.single())
    return dataclasses.replace(parts, cpu_threads=threads)


def _build_parallel_parts(config: EngineConfig, loaded: LoadedModel | None) -> EngineParts:
    """Rank 0's parts and the started workers (see the module docstring)."""
    if loaded is not None:
        raise ValueError("tensor_parallel_size > 1 loads the model itself, one shard per "
                         "rank: it cannot take a model loaded beforehand")
    load = config.load
    check_shapes(make_loader(load.model, load.load_format, load.seed).load_config(),
                 config.parallel.tensor_parallel_size)
    device = rank_device(resolve_device(config.load.device), 0)
    workers = WorkerGroup.start(config, device)
    try:
        parts = _assemble_parts(config, load_engine_model(config, workers.tp, device), device,
                                workers.tp)
        workers.send_kv_spec(KVSpec.of(parts.kv_memory.kv_cache))
    except BaseException:
        workers.close()
        raise
    return dataclasses.replace(parts, workers=workers)


def _assemble_parts(config: EngineConfig, loaded: LoadedModel, device: torch.device,
                    tp: TensorParallel) -> EngineParts:
    """The parts around a loaded model (rank 0's shard under tensor parallelism: its KV
    cache holds only this rank's KV heads)."""
    dtype = _model_dtype(config, loaded, device)
    model_config = loaded.config
    max_model_len = config.load.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's limit "
            f"{model_config.max_position_embeddings}"
        )
    cache = config.cache
    layout = model_config.kv_layout(cache.block_size, dtype, cache.kv_cache_dtype)
    layout = dataclasses.replace(layout,
                                 num_kv_heads=tp.num_local_kv_heads(model_config.num_kv_heads))
    num_blocks = kv_num_blocks(config, layout, device)
    groups = kv_groups(layout, [spec.sliding_window for spec in model_config.layer_specs],
                       max_model_len=max_model_len)
    if len(groups) > 1 or groups[0].window is not None:
        why_not = _why_not_hybrid(config)
        if why_not is None:
            kv_memory = HybridKVMemory(layout, groups, num_blocks * layout.bytes_per_block,
                                       device, enable_prefix_caching=cache.enable_prefix_caching,
                                       watermark=cache.watermark,
                                       lower=_group_tiers(config, groups, dtype, device))
            return EngineParts(model_config, loaded.model, loaded.tokenizer, device, dtype,
                               max_model_len, kv_memory, _sampling_defaults(config.load, loaded))
        logger.info("hybrid KV cache manager off (%s): sliding-window layers keep every block",
                    why_not)
    namespace = kv_namespace(config, layout, dtype)
    kv_memory = KVMemory(
        layout,
        num_blocks,
        device,
        enable_prefix_caching=cache.enable_prefix_caching,
        watermark=cache.watermark,
        elastic=_elastic_config(cache),
        host_num_bytes=int(config.tiers.swap_space * 2**30),
        disk=_disk_tier(config.tiers, layout, namespace),
        shared=_shared_tier(config.tiers, layout, namespace),
    )
    return EngineParts(model_config, loaded.model, loaded.tokenizer, device, dtype,
                       max_model_len, kv_memory, _sampling_defaults(config.load, loaded))


def _why_not_hybrid(config: EngineConfig) -> str | None:
    """Why sliding-window layers must keep every block here, or None (vLLM, too, turns its
    hybrid manager off for what it cannot serve). The elastic pool grows and shrinks a
    one-layout pool."""
    reasons = {
        "--disable-hybrid-kv-cache-manager": config.cache.disable_hybrid_kv_cache_manager,
        "--kv-pool elastic": config.cache.kv_pool != "static",
    }
    return next((reason for reason, applies in reasons.items() if applies), None)


def _sampling_defaults(load: LoadConfig, loaded: LoadedModel) -> dict[str, Any]:
    """The model's request defaults (see the module docstring), checked as SamplingParams so
    a bad generation config fails at start-up rather than in every request."""
    defaults = default_sampling_params(load.generation_config, loaded.generation_config,
                                       load.override_generation_config)
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as error:
        raise ValueError(f"the generation config's sampling defaults {defaults} are invalid "
                         f"({error}); pass generation_config='vllm' to ignore them") from None
    if defaults:
        logger.info("requests default to the generation config's %s (generation_config=%r)",
                    defaults, load.generation_config)
    return defaults


def kv_namespace(config: EngineConfig, layout: KVLayout, dtype: torch.dtype) -> str:
    """What KV computed by this engine depends on: the model (a path resolved to its real
    path, a Hub id to its snapshot), its load format and weights (a dummy load's seed), dtype,
    and the KV layout (block size, KV dtype, shape). The disk and shared tiers keep blocks
    under it, so KV computed by other weights, dtypes or shapes is never found."""
    load = config.load
    model = load.model or "bundled:SmolLM2-135M-Instruct"
    if isinstance(model, ModelConfig):  # a shape for dummy weights: named by its contents
        model = "config:" + hashlib.sha256(repr(model).encode()).hexdigest()[:16]
    elif load.model is not None and os.path.exists(resolve_model_path(model)):
        model = os.path.realpath(resolve_model_path(model))  # a Hub id: its snapshot
    return "|".join([
        f"model={model}", f"load_format={load.load_format}", f"dtype={dtype}",
        f"seed={load.seed}" if load.load_format == "dummy" else "weights",
        f"block_size={layout.block_size}", f"kv={layout.dtype}",
        f"shape={layout.block_shape}",
    ])


def _group_tiers(config: EngineConfig, groups: Sequence[KVGroup], dtype: torch.dtype,
                 device: torch.device) -> list[list[LowerTier]]:
    """Each KV cache group's host, disk and shared tiers (nearest first), in its own layout
    and namespace (its layers named: another group's blocks are never found). The host and
    disk budgets are split so that every group's tier holds as many blocks: the same
    prefix's blocks are spilled and reloaded in every group."""
    tiers, pin = config.tiers, device.type == "cuda"
    total = sum(group.page_bytes for group in groups)
    lower = []
    for group in groups:
        share = group.page_bytes / total
        namespace = (f"{kv_namespace(config, group.layout, dtype)}|layers={group.layers}"
                     f"|window={group.window}")
        host = HostKVTier.for_budget(group.layout, int(tiers.swap_space * 2**30 * share), pin)
        disk = _disk_tier(tiers, group.layout, namespace, int(tiers.kv_disk_cache_size * share))
        shared = _shared_tier(tiers, group.layout, namespace)
        lower.append([tier for tier in (host, disk, shared) if tier is not None])
    return lower


def _disk_tier(tiers: TierConfig, layout: KVLayout, namespace: str,
               capacity_bytes: int | None = None) -> DiskKVTier | None:
    """The disk tier `tiers.kv_disk_cache` names, in this engine's namespace (with its whole
    `kv_disk_cache_size`, or `capacity_bytes`)."""
    if tiers.kv_disk_cache is None:
        return None
    capacity = tiers.kv_disk_cache_size if capacity_bytes is None else capacity_bytes
    return DiskKVTier(tiers.kv_disk_cache, capacity, layout, namespace)


def _shared_tier(tiers: TierConfig, layout: KVLayout, namespace: str) -> RedisKVTier | None:
    """The shared tier in the Redis `tiers.kv_shared_redis` names, in this engine's
    namespace: replicas of the same model and layout share its blocks."""
    if tiers.kv_shared_redis is None:
        return None
    return RedisKVTier(tiers.kv_shared_redis, layout, namespace,
                       timeout=tiers.kv_shared_redis_timeout)


def _model_dtype(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> torch.dtype:
    """The loaded model's dtype, checked against an explicit `config.load.dtype`."""
    dtype = loaded.model.dtype
    asked = config.load.dtype
    if asked != AUTO and resolve_dtype(asked, device) != dtype:
        raise ValueError(f"dtype={asked!r} was asked for, but the model given is {dtype}")
    return dtype


def _elastic_config(cache: CacheConfig) -> ElasticPoolConfig | None:
    if cache.kv_pool == "static":
        return None
    options = {
        "segment_blocks": cache.kv_pool_segment_blocks,
        "initial_blocks": cache.kv_pool_initial_blocks,
        "idle_seconds": cache.kv_pool_idle_seconds,
    }
    given = {name: value for name, value in options.items() if value is not None}
    return ElasticPoolConfig(**given)


def kv_num_blocks(config: EngineConfig, layout: KVLayout, device: torch.device) -> int:
    """How many usable KV blocks the configured budget holds (see the module docstring); a
    memory budget also pays for the null block."""
    cache = config.cache
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        used_bytes = total_bytes - free_bytes
        budget = int(cache.gpu_memory_utilization * total_bytes) - used_bytes
        budget -= ACTIVATION_RESERVE_BYTES
        if budget < 2 * layout.bytes_per_block:
            raise ValueError(
                f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves no room for KV "
                f"cache: {used_bytes / 2**30:.1f} GiB of {total_bytes / 2**30:.1f} GiB is in use"
            )
    else:
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    num_rows = layout.num_blocks_for_memory(budget)
    if num_rows < 2:
        raise ValueError(f"a KV budget of {budget} bytes holds no block besides the null block "
                         f"({layout.bytes_per_block} bytes each)")
    return num_rows - 1


def make_runner(parts: EngineParts, config: EngineConfig) -> ModelRunner:
    """The model runner: rank 0's tensor-parallel one when there are workers; else one that
    replays CUDA graphs of the decode step where `config` and the device allow it
    (`kvpool.engine.decode_graphs`, captured now); else the eager one."""
    kv_cache = parts.kv_memory.kv_cache
    if parts.workers is not None:
        return TensorParallelRunner(parts.model, kv_cache, parts.device, parts.workers)
    plan = decode_plan(config, parts.model, parts.device, parts.max_model_len,
                       parts.model_config.vocab_size)
    if plan is None:
        return ModelRunner(parts.model, kv_cache, parts.device)
    return DecodeGraphRunner.capture(parts.model, kv_cache, parts.device, plan)
