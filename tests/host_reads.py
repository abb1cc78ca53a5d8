"""Counts the calls that read a tensor's values back to the host.

On a GPU each such read (`.tolist()`, `.item()`, `bool(t)`, a boolean-mask index, ...) waits for
every kernel queued before it: a read per layer or per row serialises the CPU with the GPU.
PyTorch's own sync detector (`torch.cuda.set_sync_debug_mode`) needs CUDA; this counter sees
the same calls on any device, so CPU tests can bound how many reads a step makes.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods whose result is a host value computed from the tensor's data.
_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
          "nonzero", "masked_select", "unique"}


class HostReads(TorchFunctionMode):
    """`with HostReads() as reads: ...` then `reads.counts` maps each read's name to its count
    (`to` counts only moves to the CPU; indexing only by a boolean mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS or _is_move_to_cpu(name, args, kwargs) or _is_mask_index(name, args):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _is_move_to_cpu(name: str, args, kwargs) -> bool:
    if name != "to":
        return False
    targets = [*args[1:], *(kwargs or {}).values()]
    return any(str(target) == "cpu" for target in targets if isinstance(target, str | torch.device))


def _is_mask_index(name: str, args) -> bool:
    if name != "__getitem__" or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in index)
