"""The KV tiers below the device pool (`kvpool.memory.tiers`): host memory, a disk directory
and a Redis shared by replicas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpool.engine.config.options import option, parse_size

DEFAULT_KV_DISK_CACHE_SIZE = 16 * 1024**3  # bytes of disk the disk tier may fill


@dataclass(frozen=True)
class TierConfig:
    """`swap_space` GiB of host memory (page-locked on CUDA; 0: no host tier) hold swapped-out
    sequences and prefix blocks the device evicts; `kv_disk_cache` names a directory where full
    prefix blocks are kept across restarts, up to `kv_disk_cache_size` bytes.

    Scale-out (docs/scale-out.md): `kv_shared_redis` ("redis://host:port/db") is a KV tier
    shared by every replica that names the same Redis, below the host and disk tiers and above
    recompute (`kvpool.memory.tiers.redis_tier`); a Redis call slower than
    `kv_shared_redis_timeout` seconds counts as Redis being down, and the engine carries on
    without the tier until it is back.
    """

    TITLE: ClassVar[str] = "KV tiers below the device pool"

    swap_space: float = option(
        0.0, "GiB of host memory (pinned on CUDA) for swapped-out sequences and prefix blocks "
        "the device pool evicts (0: no host tier)")
    kv_disk_cache: str | None = option(
        None, "keep full prefix blocks in DIR (salted-hash keyed files, LRU within "
        "--kv-disk-cache-size); a restarted engine finds them", metavar="DIR")
    kv_disk_cache_size: int = option(
        DEFAULT_KV_DISK_CACHE_SIZE,
        f"bytes the disk tier may hold (default {DEFAULT_KV_DISK_CACHE_SIZE >> 30}GiB)",
        parser=parse_size)
    kv_shared_redis: str | None = option(
        None, "share full prefix blocks with every replica naming the same Redis "
        "(redis://host:port/db), below the host and disk tiers; its capacity is Redis's "
        "maxmemory with maxmemory-policy allkeys-lru", metavar="URL")
    kv_shared_redis_timeout: float = option(
        0.5, "a Redis call slower than this counts as Redis down: the engine goes on without "
        "the shared tier until Redis answers again", metavar="SECONDS")

    def __post_init__(self) -> None:
        if not self.swap_space >= 0:  # also refuses NaN
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space}")
        if self.kv_disk_cache_size < 1:
            raise ValueError(
                f"kv_disk_cache_size must be at least 1 byte, got {self.kv_disk_cache_size}")
        if self.kv_disk_cache is not None and not str(self.kv_disk_cache).strip():
            raise ValueError("kv_disk_cache must name a directory (or be None)")
        if self.kv_shared_redis is None:
            return
        if not str(self.kv_shared_redis).startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("kv_shared_redis must be a redis://, rediss:// or unix:// URL, "
                             f"got {self.kv_shared_redis!r}")
        if not self.kv_shared_redis_timeout > 0:  # also refuses NaN
            raise ValueError("kv_shared_redis_timeout must be > 0 seconds, got "
                             f"{self.kv_shared_redis_timeout}")

