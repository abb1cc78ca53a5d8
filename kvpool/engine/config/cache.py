"""The device KV cache: block size, how much memory it gets, its storage dtype, the prefix
cache, admission's watermark and whether the pool is static or elastic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpool.engine.config.options import check_at_least_one, option, parse_size
from kvpool.memory.elastic_pool import ElasticPoolConfig
from kvpool.memory.kv_layout import KV_CACHE_DTYPES
from kvpool.memory.kv_pool import KV_POOL_MODES

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3  # bytes of KV cache on the CPU when nothing is said
_ELASTIC = ElasticPoolConfig()  # the elastic pool's own defaults, for the help text


@dataclass(frozen=True)
class CacheConfig:
    """KV memory is sized by the first of: `num_gpu_blocks` (a block count), `kv_cache_memory`
    (bytes), or on CUDA `gpu_memory_utilization` (fraction of the device's memory the whole
    process may use, weights included); on the CPU the default is 2 GiB. That budget is
    reserved once; `kv_pool="static"` brings all of it online at start, `"elastic"` brings it
    online a segment at a time and gives idle segments back (`kvpool.memory.elastic_pool`).
    The `kv_pool_*` options apply to the elastic pool only (None: its defaults), so a static
    pool rejects them rather than silently ignoring them.

    `kv_cache_dtype` is the KV cache's storage dtype: "auto" (the model's), a float dtype, or
    the quantized "int8", "fp8" (= "fp8_e4m3") and "fp8_e5m2" (`kvpool.memory.kv_quant`).
    """

    TITLE: ClassVar[str] = "KV cache (elastic options are rejected with a static pool)"

    block_size: int = option(16, "tokens per KV block")
    num_gpu_blocks: int | None = option(
        None, "KV blocks (over memory)", aliases=("--num-gpu-blocks-override",))
    kv_cache_memory: int | None = option(
        None, "KV cache size, e.g. 512MiB (CPU default 2GiB)", parser=parse_size,
        aliases=("--kv-cache-memory-bytes",))
    kv_cache_dtype: str = option(
        "auto", "KV cache storage: auto (the model's dtype), a float dtype, or int8 / fp8 "
        "(= fp8_e4m3) / fp8_e5m2 with a float32 scale per token and KV head",
        choices=tuple(KV_CACHE_DTYPES))
    gpu_memory_utilization: float = option(0.9)
    enable_prefix_caching: bool = option(True)
    disable_hybrid_kv_cache_manager: bool = option(
        False, "keep every layer's KV for every token; by default a sliding-window layer "
        "keeps only its window's blocks (kvpool.memory.kv_groups)")
    watermark: float = option(
        0.01, "fraction of KV blocks admission leaves free for running sequences")
    kv_pool: str = option(
        "static", "static: the whole KV budget online at start; elastic: grow by segments "
        "under pressure, give idle segments back", choices=KV_POOL_MODES)
    kv_pool_initial_blocks: int | None = option(
        None, "elastic: blocks online at start and never given back, in whole segments "
        "(0: lazy, everything given back when idle; default: one segment)")
    kv_pool_segment_blocks: int | None = option(
        None, f"elastic: blocks per segment (default {_ELASTIC.segment_blocks})")
    kv_pool_idle_seconds: float | None = option(
        None, "elastic: how long a segment's worth of blocks must stay free before it is "
        f"given back (default {_ELASTIC.idle_seconds:g})")

    def __post_init__(self) -> None:
        check_at_least_one(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks,
                           kv_cache_memory=self.kv_cache_memory)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        self._check_kv_pool()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")

    def _check_kv_pool(self) -> None:
        if self.kv_pool not in KV_POOL_MODES:
            raise ValueError(f"kv_pool must be one of {KV_POOL_MODES}, got {self.kv_pool!r}")
        elastic_options = {
            "kv_pool_initial_blocks": self.kv_pool_initial_blocks,
            "kv_pool_segment_blocks": self.kv_pool_segment_blocks,
            "kv_pool_idle_seconds": self.kv_pool_idle_seconds,
        }
        given = [name for name, value in elastic_options.items() if value is not None]
        if self.kv_pool == "static" and given:
            raise ValueError(f"{', '.join(given)} apply only to kv_pool='elastic' (a static "
                             "pool brings its whole budget online at start)")
        if (self.kv_pool_initial_blocks or 0) < 0 or (self.kv_pool_idle_seconds or 0) < 0:
            raise ValueError("kv_pool_initial_blocks and kv_pool_idle_seconds must be >= 0")
        check_at_least_one(kv_pool_segment_blocks=self.kv_pool_segment_blocks)
