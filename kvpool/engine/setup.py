"""Engine start-up: load the model, size the KV cache from the memory budget, build the pool.

Sizing rule, first match wins:
1. `num_gpu_blocks`: exactly that many blocks;
2. `kv_cache_memory`: that many bytes of KV;
3. on CUDA: `gpu_memory_utilization` × device memory, minus what the process already holds
   after loading the weights, minus a reserve for a step's activations;
4. on the CPU: 2 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.attention.selector import get_attention_backend
from kvpool.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from kvpool.memory.block_pool import BlockPool
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
    kv_cache = KVCache(
        num_blocks,
        model_config.num_layers,
        config.block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        dtype=dtype,
        device=device,
    )
    pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
    return EngineParts(
        model_config,
        loaded.model,
        loaded.tokenizer,
        pool,
        kv_cache,
        device,
        max_model_len,
        loaded.load_seconds,
    )


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
