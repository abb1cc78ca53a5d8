"""Engine start-up: load the model, size the KV budget, reserve it once, build the pool.

Sizing rule, first match wins:
1. `num_gpu_blocks`: exactly that many blocks;
2. `kv_cache_memory`: that many bytes of KV;
3. on CUDA: `gpu_memory_utilization` × device memory, minus what the process already holds
   after loading the weights, minus a reserve for a step's activations;
4. on the CPU: 2 GiB.

The budget is reserved as ONE arena buffer (`Arena.reserve`) of `num_blocks * bytes_per_block`
bytes, and the KV cache is carved from it: in static mode one exact allocation of every block
(the KV tensor a view of it); in elastic mode segments, taken and given back as the load
changes (`kvpool.memory.elastic_pool`).

Working buffers (a step's activations, logits, attention metadata) are *not* taken from the
arena: they are short-lived tensors of varying shape that torch's caching allocator already
recycles without device calls, and taking them from the arena would mean threading
preallocated outputs through every model layer. On CUDA the activation reserve above leaves
them room; the arena holds KV blocks and nothing else, so every arena byte is a potential block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.attention.selector import get_attention_backend
from kvpool.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from kvpool.memory.arena import Arena
from kvpool.memory.arena_free_list import align_up
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.elastic_pool import ElasticKVPool, ElasticPoolConfig, KVPool, StaticKVPool
from kvpool.memory.kv_cache import KVCache, kv_bytes_per_block, num_blocks_for_memory
from kvpool.model.config import ModelConfig
from kvpool.model.loaders.auto import load_model, resolve_dtype
from kvpool.model.loaders.base import LoadedModel
from kvpool.model.tokenizer import Tokenizer

# Room for one step's activations and logits when the KV budget comes from the device's size.
ACTIVATION_RESERVE_BYTES = 1024**3


@dataclass(frozen=True)
class EngineParts:
    model_config: ModelConfig
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    pool: BlockPool
    kv_cache: KVCache
    device: torch.device
    max_model_len: int
    load_seconds: float
    kv_pool: KVPool  # owns the arena; pool and kv_cache above are its own


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    return device


def load_engine_model(config: EngineConfig) -> LoadedModel:
    """Load the configured model (weights, tokenizer) on the configured device."""
    device = resolve_device(config.device)
    return load_model(
        config.model,
        load_format=config.load_format,
        dtype=resolve_dtype(config.dtype),
        device=device,
        attention_backend=get_attention_backend(config.attention_backend, device),
        seed=config.seed,
    )


def build_engine_parts(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Everything an engine runs on; pass `loaded` to reuse a model already in memory."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype)
    loaded = loaded or load_engine_model(config)
    model_config = loaded.config
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's limit "
            f"{model_config.max_position_embeddings}"
        )
    num_blocks = kv_num_blocks(config, model_config, dtype, device)
    kv_pool = build_kv_pool(config, model_config, dtype, device, num_blocks)
    return EngineParts(
        model_config,
        loaded.model,
        loaded.tokenizer,
        kv_pool.pool,
        kv_pool.kv_cache,
        device,
        max_model_len,
        loaded.load_seconds,
        kv_pool,
    )


def build_kv_pool(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
) -> KVPool:
    """Reserve the arena for `num_blocks` blocks and lay the configured pool over it."""
    shape = (model_config.num_layers, config.block_size, model_config.num_kv_heads,
             model_config.head_dim)
    bytes_per_block = kv_bytes_per_block(*shape, dtype)
    arena = Arena.reserve(align_up(num_blocks * bytes_per_block, 256), device)
    if config.kv_pool == "static":
        handle = arena.allocate(num_blocks * bytes_per_block, alignment=bytes_per_block,
                                size_class=False)
        storage = handle.view(torch.uint8)
        kv_cache = KVCache(num_blocks, *shape, dtype=dtype, device=device, storage=storage)
        pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        return StaticKVPool(pool, kv_cache, arena)
    capacity_blocks = arena.num_reserved_bytes // bytes_per_block
    kv_cache = KVCache(capacity_blocks, *shape, dtype=dtype, device=device, storage=arena.buffer)
    pool = BlockPool(0, config.block_size, config.enable_prefix_caching, capacity_blocks)
    options = {
        "segment_blocks": config.kv_pool_segment_blocks,
        "initial_blocks": config.kv_pool_initial_blocks,
        "idle_seconds": config.kv_pool_idle_seconds,
    }
    elastic_config = ElasticPoolConfig(
        low_watermark_blocks=int(config.watermark * num_blocks),
        **{name: value for name, value in options.items() if value is not None},
    )
    return ElasticKVPool(pool, kv_cache, arena, elastic_config)


def kv_num_blocks(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """How many KV blocks the configured budget holds (see the module docstring)."""
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    bytes_per_block = kv_bytes_per_block(
        model_config.num_layers,
        config.block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        dtype,
    )
    if config.kv_cache_memory is not None:
        return num_blocks_for_memory(config.kv_cache_memory, bytes_per_block)
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        used_bytes = total_bytes - free_bytes
        budget = int(config.gpu_memory_utilization * total_bytes) - used_bytes
        budget -= ACTIVATION_RESERVE_BYTES
        if budget < bytes_per_block:
            raise ValueError(
                f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no room for KV "
                f"cache: {used_bytes / 2**30:.1f} GiB of {total_bytes / 2**30:.1f} GiB is in use"
            )
        return num_blocks_for_memory(budget, bytes_per_block)
    return num_blocks_for_memory(DEFAULT_CPU_KV_CACHE_MEMORY, bytes_per_block)
