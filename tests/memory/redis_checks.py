"""Tiers and damage the shared (Redis) tier's tests share (test_redis_tier,
test_redis_tier_machine): every tier here talks to a real redis-server (`redis_server`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from disk_checks import NAMESPACE, make_block

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.tiers.disk_block_format import encode_block
from kvpool.memory.tiers.redis_tier import RedisKVTier, shared_key

FAST = {"timeout": 0.2, "probe_interval": 0.02}  # a tier that notices outages quickly
DAMAGE = ("flipped_byte", "truncated", "other_tokens", "junk")


def make_tier(url: str, layout: KVLayout, namespace: str = NAMESPACE, **options) -> RedisKVTier:
    return RedisKVTier(url, layout, namespace, **{**FAST, **options})


def key_of(layout: KVLayout, key: int, namespace: str = NAMESPACE) -> str:
    return shared_key(namespace, make_block(layout, key)[0])


def damaged_value(value: bytes, kind: str, layout: KVLayout, key: int) -> bytes:
    """`value` (a good block's) damaged as `kind` says: what a bad replica or a bad disk
    under Redis could leave."""
    if kind == "flipped_byte":
        data = bytearray(value)
        data[len(data) - 3] ^= 0x10  # in the tensors' payload: only the checksum sees it
        return bytes(data)
    if kind == "truncated":
        return value[: len(value) // 2]
    if kind == "other_tokens":  # a whole, well-formed block of other tokens under this hash
        block_hash, tokens, kv, scales = make_block(layout, key)
        return encode_block(NAMESPACE, block_hash, [token + 1 for token in tokens], kv, scales)
    assert kind == "junk"
    return b"\x00not a block"


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
