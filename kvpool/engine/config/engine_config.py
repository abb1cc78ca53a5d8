"""`EngineConfig`: the engine's options as six frozen sections, built from vLLM's flat names.

Invariant: every option name belongs to exactly one section (`OPTION_SECTIONS`, checked at
import), so a flat keyword (`block_size=8`) routes to one place and a flag maps to one field.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from kvpool.engine.config.cache import CacheConfig
from kvpool.engine.config.load import LoadConfig
from kvpool.engine.config.observability import ObservabilityConfig
from kvpool.engine.config.parallel import ParallelConfig
from kvpool.engine.config.scheduling import SchedulingConfig
from kvpool.engine.config.tiers import TierConfig

SECTIONS: dict[str, type] = {
    "load": LoadConfig,
    "cache": CacheConfig,
    "scheduling": SchedulingConfig,
    "tiers": TierConfig,
    "parallel": ParallelConfig,
    "observability": ObservabilityConfig,
}
OPTION_SECTIONS: dict[str, str] = {  # option name -> the section that owns it
    option.name: section for section, cls in SECTIONS.items() for option in dataclasses.fields(cls)
}
assert len(OPTION_SECTIONS) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values()), \
    "an option name is declared in two sections"


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Everything the engine needs to start, named as in vLLM so users can switch.

    Each section owns its options, their defaults and their own checks; this class checks
    what spans sections. Build it from vLLM's flat names, sections, or both:

        EngineConfig(model="m.gguf", block_size=8, swap_space=1)
        EngineConfig(cache=CacheConfig(block_size=8), swap_space=1)

    A flat name goes to the section that declares it (`OPTION_SECTIONS`), over the section
    given (or the section's defaults); an unknown name is a TypeError naming it. Read options
    from their section: `config.cache.block_size`. `dataclasses.replace(config, dtype=...)`
    takes flat names too. vLLM arguments with no counterpart here are sorted out before this
    config is built (`kvpool.engine.vllm_compat`).
    """

    load: LoadConfig
    cache: CacheConfig
    scheduling: SchedulingConfig
    tiers: TierConfig
    parallel: ParallelConfig
    observability: ObservabilityConfig

    def __init__(self, **options: Any) -> None:
        flat: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, value in options.items():
            if name not in OPTION_SECTIONS and name not in SECTIONS:
                raise TypeError(f"EngineConfig got an unknown option {name!r}{_hint(name)}")
            if name in OPTION_SECTIONS:
                flat[OPTION_SECTIONS[name]][name] = value
        for section, cls in SECTIONS.items():
            given = options.get(section) or cls()
            if not isinstance(given, cls):
                raise TypeError(f"EngineConfig's {section} must be a {cls.__name__}, "
                                f"got {type(given).__name__}")
            value = dataclasses.replace(given, **flat[section]) if flat[section] else given
            object.__setattr__(self, section, value)
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        cache, tiers = self.cache, self.tiers
        if self.scheduling.preemption_mode == "swap" and tiers.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (GiB)")
        if tiers.kv_disk_cache is not None and not cache.enable_prefix_caching:
            raise ValueError("kv_disk_cache keeps prefix blocks: it needs enable_prefix_caching")
        if tiers.kv_shared_redis is not None and not cache.enable_prefix_caching:
            raise ValueError("kv_shared_redis shares prefix blocks: it needs "
                             "enable_prefix_caching")
        self._check_tensor_parallel()
        self._check_kv_transfer()

    def _check_kv_transfer(self) -> None:
        """A KV connector finds and publishes handed-over blocks through the prefix cache,
        and registers one fixed set of KV tensors with its transport."""
        if self.parallel.kv_transfer_config is None:
            return
        unsupported = {
            "enable_prefix_caching=False": not self.cache.enable_prefix_caching,
            "kv_pool='elastic'": self.cache.kv_pool == "elastic",
            "tensor_parallel_size > 1": self.parallel.tensor_parallel_size > 1,
        }
        for option, given in unsupported.items():
            if given:
                raise ValueError(f"kv_transfer_config does not support {option} (handed-over "
                                 "blocks go through the prefix cache of one static KV pool)")

    def _check_tensor_parallel(self) -> None:
        """Refuse, naming the option, what tp > 1 does not support yet (the model's shapes
        are checked when it is loaded: `kvpool.model.parallel.check_shapes`)."""
        if self.parallel.tensor_parallel_size == 1:
            return
        device = self.load.device
        unsupported = {
            "swap_space": self.tiers.swap_space > 0,
            "kv_disk_cache": self.tiers.kv_disk_cache is not None,
            "kv_shared_redis": self.tiers.kv_shared_redis is not None,
            "kv_pool='elastic'": self.cache.kv_pool == "elastic",
            f"device={device!r}": device.split(":")[0] not in ("cpu", "cuda", "auto"),
        }
        for option, given in unsupported.items():
            if given:
                raise ValueError(f"tensor_parallel_size > 1 does not support {option} yet "
                                 "(one KV tier on each rank's device, a static pool, on the "
                                 "CPU or CUDA)")


def _hint(name: str) -> str:
    match = difflib.get_close_matches(name, sorted(OPTION_SECTIONS), n=1)
    return f"; did you mean {match[0]!r}?" if match else ""
