"""The CUDA side stream that the KV transfers copy on, and its ordering against the compute
stream, behind one small object.

`KVTransfers` asks it for exactly six things: make the side stream wait for what the compute
stream has queued (`wait_for_compute`), run copies on the side stream (`copying`), keep a
tensor made on the compute stream alive until the side stream has read it (`reads`), record an
event after them (`record_event`), make the compute stream wait for such an event
(`make_compute_wait`: a device-side wait, the CPU goes on) and wait for everything on the CPU
(`synchronize`); plus a page-locked host copy of a device tensor (`to_host`). Naming them here
keeps the transfers' ordering readable, and lets a CPU test swap in an ordering model
(tests/memory/side_stream_model.py) that checks who waits for whom.

On the CPU there is no side stream (`for_device` gives None): copies are plain memcpys, done
when `KVTransfers.run` returns.
"""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    """One CUDA stream beside the compute stream (`torch.cuda.current_stream` of the device)."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == "cuda", f"a side stream needs a CUDA device, got {device}"
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @classmethod
    def for_device(cls, device: torch.device) -> SideStream | None:
        """A side stream on a CUDA device; None on the CPU (copies are synchronous)."""
        return cls(device) if device.type == "cuda" else None

    def wait_for_compute(self) -> None:
        """Later side-stream work starts after everything the compute stream queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copying(self) -> contextlib.AbstractContextManager:
        """Within it, copies (and any kernel) are queued on the side stream."""
        return torch.cuda.stream(self.stream)

    def reads(self, tensor: torch.Tensor) -> None:
        """Side-stream work queued so far reads `tensor`, which the compute stream allocated:
        its memory must not go back to the compute stream's pool until that work is done.
        (The caching allocator tracks only the allocating stream; without this, the next
        allocation there could overwrite the tensor while the side stream still reads it.)"""
        tensor.record_stream(self.stream)

    def record_event(self) -> torch.cuda.Event:
        """An event that completes once the side-stream work queued so far has."""
        return self.stream.record_event()

    def make_compute_wait(self, event: torch.cuda.Event) -> None:
        """Later compute-stream work starts after `event` (device side; the CPU goes on)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """The CPU waits for everything queued on the side stream."""
        self.stream.synchronize()

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked CPU copy of `tensor`, queued on the current stream (non-blocking)."""
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor, non_blocking=True)
        return out
