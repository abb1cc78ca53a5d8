"""A CPU stand-in for `SideStream` (`kvpool.memory.tiers.side_stream`) that models CUDA's
ordering, so a CPU test can check who waits for whom.

The copies themselves run at once (CPU tensors), but every event recorded after them stays
*pending*, as if the side stream were still copying, until `finish()` (or `synchronize()`)
says the side stream caught up. The compute stream's waits are recorded on the events. A
pending event the compute stream was not made to wait for is *unordered*: on a GPU, compute
work queued now could run before (or during) that copy. Code that must not touch a block a
copy in flight reads checks that `unordered()` is empty at that moment.
"""

from __future__ import annotations

import contextlib

import torch


class ModelEvent:
    def __init__(self) -> None:
        self.is_done = False  # the side stream finished the work before it
        self.is_waited_by_compute = False  # compute work queued since runs after it

    def query(self) -> bool:
        return self.is_done

    def synchronize(self) -> None:
        self.is_done = True


class ModelSideStream:
    """`SideStream`'s interface; copies are immediate, their events pending until finished."""

    def __init__(self) -> None:
        self.events: list[ModelEvent] = []
        self.read_tensors: list[torch.Tensor] = []  # what `reads` was told the stream reads

    def wait_for_compute(self) -> None:
        pass  # the copies run now, after everything the (CPU) compute did so far

    def copying(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def reads(self, tensor: torch.Tensor) -> None:
        self.read_tensors.append(tensor)

    def record_event(self) -> ModelEvent:
        event = ModelEvent()
        self.events.append(event)
        return event

    def make_compute_wait(self, event: ModelEvent) -> None:
        event.is_waited_by_compute = True

    def synchronize(self) -> None:
        self.finish()

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def finish(self) -> None:
        """The side stream caught up: every event so far is done."""
        for event in self.events:
            event.is_done = True

    def unordered(self) -> list[ModelEvent]:
        """Pending events the compute stream does not wait for."""
        return [event for event in self.events
                if not event.is_done and not event.is_waited_by_compute]
