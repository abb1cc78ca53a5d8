"""KV events: what enters and leaves an engine's prefix caches, in vLLM's wire format.

Why a ZMQ PUB socket and not a Redis stream: publishing is a local enqueue, with no broker
hop on the step's path and no broker to run; a consumer that misses events (a slow
subscriber, a dropped connection, a restarted replica) notices the gap in sequence numbers and
resyncs from the replica's `GET /v1/kv/events/snapshot`, so no durability is needed from the
transport; and it is the vLLM ecosystem's format, so vLLM, Dynamo and llm-d consumers read
kvpool replicas as they read vLLM's. Redis stays optional (the shared KV tier only).

Wire format (vLLM's `vllm.distributed.kv_events`): every message has three frames,

    [topic (UTF-8), seq (8 bytes, big-endian), msgpack(KVEventBatch)]

    KVEventBatch  [ts, [event, ...], data_parallel_rank]     (the rank: None here)
    event         ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                   lora_id, medium]
                | ["BlockRemoved", block_hashes, medium]
                | ["AllBlocksCleared"]

Block hashes are `kvpool.memory.prefix_cache`'s 32-byte salted chain; `medium` names the tier
("device" or "host"), and for a hybrid model's KV cache groups past the first
(`kvpool.memory.kv_groups`) the group too: "device/g1", "host/g1"
(`kvpool.formats.kv_media.group_medium`). Each group
caches the same prefix's blocks under the same hashes; a consumer that places prompts reads the
first group's (`kv_media.split_medium`), the full-attention layers', whose blocks a hit needs
all of. A
one-group engine's messages are vLLM's byte for byte, and a consumer that knows nothing of
groups sees one more medium per group. A BlockStored carries a run of chained blocks of one medium:
`parent_block_hash` is the parent of the run's first block (None for a prompt's first block,
or a host block whose parent this log never heard of), each later hash chains on the one
before, and `token_ids` are the run's tokens, `block_size` per block, or empty (the default:
hashes only, `KVEventsConfig.include_token_ids`).

The producer is `kvpool.engine.observability.event_log.KVEventLog`; the router's
`kvpool.router.kv_event_subscriber` and `prefix_index` consume. This module imports no torch.
"""


from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvpool.memory.block_pool import DEVICE, HOST

__all__ = ["DEVICE", "HOST", "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventSnapshot",
           "KVEventBatch", "decode_message", "encode_message"]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event's first field on the wire is its class name (msgspec's tag)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encode_message(topic: str, seq: int, batch: KVEventBatch) -> list[bytes]:
    """The three frames of one message (module docstring)."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def decode_message(frames: Sequence[bytes]) -> tuple[int, KVEventBatch]:
    """(seq, batch) from a message's frames; ValueError for anything else (msgspec's
    DecodeError is one)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV event message has 3 frames with an 8-byte seq, got "
                         f"{[len(frame) for frame in frames]} bytes")
    return int.from_bytes(frames[1], "big"), msgspec.msgpack.decode(frames[2],
                                                                     type=KVEventBatch)


@dataclass(frozen=True, slots=True)
class EventSnapshot:
    """Every (hash, medium) an engine's prefix caches hold, as of batch `seq`."""

    seq: int
    blocks: list[tuple[bytes, str]]
