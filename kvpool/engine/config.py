"""Engine options, named as in vLLM so users can switch, checked when the config is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.attention.selector import ATTENTION_BACKENDS
from kvpool.engine.generation_config import check_generation_config_source
from kvpool.engine.observability.events_config import KVEventsConfig
from kvpool.memory.kv_layout import KV_CACHE_DTYPES
from kvpool.memory.kv_pool import KV_POOL_MODES
from kvpool.model.dtype import canonical_dtype_name

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3  # bytes of KV cache on the CPU when nothing is said
DEFAULT_CHUNKED_BATCHED_TOKENS = 1024
DEFAULT_KV_DISK_CACHE_SIZE = 16 * 1024**3  # bytes of disk the disk tier may fill
PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start.

    KV memory is sized by the first of: `num_gpu_blocks` (a block count), `kv_cache_memory`
    (bytes), or on CUDA `gpu_memory_utilization` (fraction of the device's memory the whole
    process may use, weights included); on the CPU the default is 2 GiB. That budget is
    reserved once; `kv_pool="static"` brings all of it online at start, `"elastic"` brings it
    online a segment at a time and gives idle segments back (`kvpool.memory.elastic_pool`).
    The `kv_pool_*` options apply to the elastic pool only (None: its defaults), so a static
    pool rejects them rather than silently ignoring them.

    `dtype` is kept by name, normalised to "auto", "float32", "bfloat16" or "float16" (aliases
    such as "bf16" or "half", and torch dtypes, are accepted); "auto" becomes a concrete dtype
    when the model is loaded (`kvpool.model.dtype.resolve_dtype`; the engine's `dtype`).
    `kv_cache_dtype` is the KV cache's storage dtype: "auto" (the model's), a float dtype, or
    the quantized "int8", "fp8" (= "fp8_e4m3") and "fp8_e5m2" (`kvpool.memory.kv_quant`).

    Tiers below the device pool (`kvpool.memory.tiers.kv_tiers`): `swap_space` GiB of host memory
    (page-locked on CUDA; 0: no host tier) hold swapped-out sequences and prefix blocks the
    device evicts; `kv_disk_cache` names a directory where full prefix blocks are kept across
    restarts, up to `kv_disk_cache_size` bytes. `preemption_mode` says what a preempted
    sequence's KV becomes: "recompute" (dropped), "swap" (copied to the host tier, back on
    resumption), or "auto" (per victim, whichever the measured copy and prefill rates say is
    cheaper; recompute without a host tier).

    `model` is a path or a Hugging Face Hub id in the local Hub cache. `generation_config`
    says where requests' sampling defaults come from, as in vLLM: "auto" (the model's
    generation_config.json), "vllm" (none: SamplingParams' own) or a directory holding such a
    file; `override_generation_config` (HF names, e.g. {"temperature": 0.5}) is merged over
    them (`kvpool.engine.generation_config`). vLLM arguments with no counterpart here are
    sorted out before this config is built (`kvpool.engine.vllm_compat`).

    `tensor_parallel_size` (vLLM's name) splits the model over that many ranks
    (`kvpool.engine.parallel`: rank 0 is this process, the others are spawned workers or
    torchrun's ranks). A collective that waits longer than `distributed_timeout_seconds` for a
    peer fails the step, so a hung worker becomes an error, not a hang.
    `tensor_parallel_overlap_chunks` > 1 all-reduces each row-parallel layer's output in that
    many pieces, each in flight while the next is multiplied. The first version
    refuses, with tp > 1, the host and disk KV tiers, the elastic pool and devices other than
    the CPU and CUDA.

    `kv_trace` names a file the engine writes its KV allocation events to, one JSON line each
    (`kvpool.formats.kv_trace`); its directory must exist. None: nothing is recorded.

    Scale-out (docs/scale-out.md): `kv_shared_redis` ("redis://host:port/db") is a KV tier
    shared by every replica that names the same Redis, below the host and disk tiers and above
    recompute (`kvpool.memory.tiers.redis_tier`); a Redis call slower than `kv_shared_redis_timeout`
    seconds counts as Redis being down, and the engine carries on without the tier until it
    is back. `kv_events_config` (vLLM's option; a dict or its JSON text is accepted) publishes
    the engine's block stored / removed / cleared events for a prefix-aware router
    (`kvpool.engine.observability.events_config`).
    """

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct; a path or a Hub id
    load_format: str = "auto"
    dtype: str = "auto"  # bfloat16 where the device runs it natively, else float32
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own limit
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # the model's dtype; int8 / fp8 store codes with scales
    watermark: float = 0.01  # fraction of blocks admission leaves free for running sequences
    kv_pool: str = "static"  # "static" or "elastic"
    kv_pool_initial_blocks: int | None = None  # online at start and the floor (0: lazy)
    kv_pool_segment_blocks: int | None = None  # blocks per segment; default 128
    kv_pool_idle_seconds: float | None = None  # idle time before a shrink; default 10
    enable_warmup: bool = True  # run a dummy batch at start-up (first-use costs paid there)
    swap_space: float = 0.0  # GiB of host KV tier (vLLM's name); 0: none
    preemption_mode: str = "auto"  # "auto", "recompute" or "swap"
    kv_disk_cache: str | None = None  # directory of the disk KV tier; None: none
    kv_disk_cache_size: int = DEFAULT_KV_DISK_CACHE_SIZE  # bytes the disk tier may hold
    generation_config: str = "auto"  # "auto", "vllm" or a directory (sampling defaults)
    override_generation_config: dict[str, Any] | None = None  # merged over those defaults
    kv_trace: str | None = None  # file of KV allocation events (--kv-trace); None: none
    kv_shared_redis: str | None = None  # redis://… URL of the shared KV tier; None: none
    kv_shared_redis_timeout: float = 0.5  # seconds one Redis call may take before it fails
    kv_events_config: KVEventsConfig | None = None  # KV event publishing (vLLM's option)
    tensor_parallel_size: int = 1  # ranks the model is split over (vLLM's name)
    distributed_timeout_seconds: float = 60.0  # a collective's longest wait for a peer
    tensor_parallel_overlap_chunks: int = 1  # row-parallel all-reduces in pieces, overlapped

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype_name(self.dtype))
        check_generation_config_source(self.generation_config)
        if self.override_generation_config is not None:
            if not isinstance(self.override_generation_config, Mapping):
                raise ValueError("override_generation_config must be a dict of "
                                 "generation_config.json fields, e.g. {'temperature': 0.5}")
            object.__setattr__(self, "override_generation_config",
                               dict(self.override_generation_config))
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "num_gpu_blocks": self.num_gpu_blocks,
            "kv_cache_memory": self.kv_cache_memory,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        self._check_kv_pool()
        self._check_kv_tiers()
        self._check_kv_trace()
        self._check_scale_out()
        self._check_tensor_parallel()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )

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
        if self.kv_pool_segment_blocks is not None and self.kv_pool_segment_blocks < 1:
            raise ValueError(
                f"kv_pool_segment_blocks must be at least 1, got {self.kv_pool_segment_blocks}"
            )

    def _check_kv_tiers(self) -> None:
        if not self.swap_space >= 0:  # also refuses NaN
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (GiB)")
        if self.kv_disk_cache_size < 1:
            raise ValueError(
                f"kv_disk_cache_size must be at least 1 byte, got {self.kv_disk_cache_size}")
        if self.kv_disk_cache is not None and not str(self.kv_disk_cache).strip():
            raise ValueError("kv_disk_cache must name a directory (or be None)")
        if self.kv_disk_cache is not None and not self.enable_prefix_caching:
            raise ValueError("kv_disk_cache keeps prefix blocks: it needs enable_prefix_caching")

    def _check_scale_out(self) -> None:
        object.__setattr__(self, "kv_events_config",
                           KVEventsConfig.from_value(self.kv_events_config))
        if self.kv_shared_redis is None:
            return
        if not str(self.kv_shared_redis).startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("kv_shared_redis must be a redis://, rediss:// or unix:// URL, "
                             f"got {self.kv_shared_redis!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_shared_redis shares prefix blocks: it needs "
                             "enable_prefix_caching")
        if not self.kv_shared_redis_timeout > 0:  # also refuses NaN
            raise ValueError("kv_shared_redis_timeout must be > 0 seconds, got "
                             f"{self.kv_shared_redis_timeout}")

    def _check_tensor_parallel(self) -> None:
        """Refuse, naming the option, what tp > 1 does not support yet (the model's shapes
        are checked when it is loaded: `kvpool.model.parallel.check_shapes`)."""
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        overlap = self.tensor_parallel_overlap_chunks
        if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 1:
            raise ValueError(f"tensor_parallel_overlap_chunks must be an integer >= 1, got "
                             f"{overlap!r}")
        if not self.distributed_timeout_seconds > 0:  # also refuses NaN
            raise ValueError("distributed_timeout_seconds must be > 0, got "
                             f"{self.distributed_timeout_seconds}")
        if size == 1:
            return
        unsupported = {
            "swap_space": self.swap_space > 0,
            "kv_disk_cache": self.kv_disk_cache is not None,
            "kv_shared_redis": self.kv_shared_redis is not None,
            "kv_pool='elastic'": self.kv_pool == "elastic",
            f"device={self.device!r}": self.device.split(":")[0] not in ("cpu", "cuda", "auto"),
        }
        for option, given in unsupported.items():
            if given:
                raise ValueError(f"tensor_parallel_size > 1 does not support {option} yet "
                                 "(one KV tier on each rank's device, a static pool, on the "
                                 "CPU or CUDA)")

    def _check_kv_trace(self) -> None:
        if self.kv_trace is None:
            return
        path = Path(self.kv_trace)
        if not str(self.kv_trace).strip() or path.is_dir():
            raise ValueError(f"kv_trace (--kv-trace) must name a file, got {self.kv_trace!r}")
        if not path.parent.is_dir():
            raise ValueError(f"kv_trace (--kv-trace): the directory of {self.kv_trace!r} "
                             f"does not exist ({str(path.parent)!r})")

    def batched_tokens_limit(self, max_model_len: int) -> int:
        """Tokens per step: a chunk size with chunked prefill, else room for a whole prompt."""
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    "without chunked prefill, max_num_batched_tokens "
                    f"({self.max_num_batched_tokens}) must be at least max_model_len "
                    f"({max_model_len})"
                )
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return DEFAULT_CHUNKED_BATCHED_TOKENS
        return max(max_model_len, DEFAULT_CHUNKED_BATCHED_TOKENS)
