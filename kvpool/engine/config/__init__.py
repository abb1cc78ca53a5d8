"""Engine options, named as in vLLM so users can switch, checked when the config is built.

`EngineConfig` (`engine_config`) composes one frozen section per concern, each in its own
module owning its options' defaults, CLI facts and checks:

- `LoadConfig` (`load`): the model, its dtype, device, seed, attention backend, sampling
  defaults, warm-up;
- `CacheConfig` (`cache`): block size, KV memory, KV dtype, prefix caching, static or elastic;
- `SchedulingConfig` (`scheduling`): sequences and tokens per step, chunked prefill,
  preemption;
- `TierConfig` (`tiers`): host, disk and shared Redis tiers;
- `ParallelConfig` (`parallel`): tensor parallelism;
- `ObservabilityConfig` (`observability`): the KV trace and KV event publishing.

Every option is declared once with `options.option` (default, help, choices, parser,
aliases); `kvpool.cli.args` generates the flags from those declarations.
"""

from kvpool.engine.config.cache import DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig
from kvpool.engine.config.engine_config import OPTION_SECTIONS, SECTIONS, EngineConfig
from kvpool.engine.config.load import LoadConfig
from kvpool.engine.config.observability import ObservabilityConfig
from kvpool.engine.config.parallel import ParallelConfig
from kvpool.engine.config.scheduling import (
    DEFAULT_CHUNKED_BATCHED_TOKENS,
    PREEMPTION_MODES,
    SchedulingConfig,
)
from kvpool.engine.config.tiers import DEFAULT_KV_DISK_CACHE_SIZE, TierConfig

__all__ = [
    "DEFAULT_CHUNKED_BATCHED_TOKENS",
    "DEFAULT_CPU_KV_CACHE_MEMORY",
    "DEFAULT_KV_DISK_CACHE_SIZE",
    "OPTION_SECTIONS",
    "PREEMPTION_MODES",
    "SECTIONS",
    "CacheConfig",
    "EngineConfig",
    "LoadConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "SchedulingConfig",
    "TierConfig",
]
