"""What rank 0 tells its workers, over the control group, one pickled object per message.

    KVSpec       once, at start-up: the KV layout (local KV heads) and the block count, so
                 every rank's KV cache has the same block ids as rank 0's pool; for a hybrid
                 pool a GroupedKVSpec: its groups (local KV heads), page unit and bytes, so
                 every rank's group views have the same ids
    StepMessage  every step: the block copies to apply first, then the model inputs (None
                 for a step of copies only)
    None         stop: the worker leaves its loop

Inputs travel on the CPU (gloo pickles them) and each rank moves them to its own device:
a CUDA tensor pickled on rank 0 would come back on rank 0's GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvpool.engine.model_runner import StepInputs
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.group_kv_cache import GroupedKVCache
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_groups import KVGroup
from kvpool.memory.kv_layout import KVLayout


@dataclass(frozen=True, slots=True)
class KVSpec:
    layout: KVLayout  # rank 0's: block size, dtype and the local KV heads every rank holds
    num_blocks: int  # rows of the KV tensor, the null block included

    @classmethod
    def of(cls, cache: KVCache | GroupedKVCache) -> KVSpec | GroupedKVSpec:
        """The spec rank 0's KV cache is built from."""
        if isinstance(cache, GroupedKVCache):
            return GroupedKVSpec(cache.groups, cache.unit, cache.nbytes)
        return cls(cache.layout, cache.num_blocks)

    def allocate(self, device: torch.device) -> KVCache:
        return KVCache(self.layout, self.num_blocks, device)


@dataclass(frozen=True, slots=True)
class GroupedKVSpec:
    groups: tuple[KVGroup, ...]  # rank 0's KV cache groups, their layouts' local KV heads
    unit: int  # bytes: pages start at whole multiples of it
    num_bytes: int  # the reservation, the null page included

    def allocate(self, device: torch.device) -> GroupedKVCache:
        buffer = torch.empty(self.num_bytes, dtype=torch.uint8, device=device)
        return GroupedKVCache(self.groups, self.unit, buffer)


@dataclass(frozen=True, slots=True)
class StepMessage:
    block_copies: tuple[BlockCopy, ...]
    inputs: StepInputs | None


def send(message: Any, control: Any) -> None:
    """Rank 0: hand `message` to every worker."""
    dist.broadcast_object_list([message], src=0, group=control)


def receive(control: Any) -> Any:
    """A worker: wait for rank 0's next message."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def inputs_to(inputs: StepInputs, device: torch.device) -> StepInputs:
    """`inputs` with every tensor (its attention metadata's too) on `device`."""
    plans = tuple(_tensors_to(plan, device) for plan in inputs.plans)
    return dataclasses.replace(_tensors_to(inputs, device), plans=plans)


def _tensors_to(record: Any, device: torch.device) -> Any:
    moved = {field.name: getattr(record, field.name).to(device)
             for field in dataclasses.fields(record)
             if isinstance(getattr(record, field.name), torch.Tensor)}
    return dataclasses.replace(record, **moved)
