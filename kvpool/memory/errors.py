"""The memory core's errors: what a caller asked of the block pool that it cannot do."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than the pool can give."""

    def __init__(self, num_requested: int, num_free: int, num_evictable: int) -> None:
        self.num_requested = num_requested
        self.num_free = num_free
        self.num_evictable = num_evictable
        super().__init__(
            f"out of KV blocks: requested {num_requested}, but only {num_free} free and "
            f"{num_evictable} evictable cached blocks are left"
        )


class InvalidBlockError(ValueError):
    """Raised for an id the pool does not own, or one in the wrong state for the call."""
