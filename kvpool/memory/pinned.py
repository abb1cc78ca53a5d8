"""Page-locked host tensors of exactly the size asked for.

`torch.zeros(..., pin_memory=True)` goes through PyTorch's caching host allocator, which rounds
every request up to the next power of two: a 40 GiB swap space would lock 64 GiB of the host's
memory, 24 GiB of it unused and unavailable to anything else on the machine. Instead the tensor
is allocated as ordinary (pageable) memory and then page-locked in place with
`cudaHostRegister`, which locks exactly its pages; it is unregistered when the tensor is
garbage-collected. Registered memory is what `is_pinned()` reports and what asynchronous
copies to and from the GPU need.
"""

from __future__ import annotations

import weakref

import torch


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, page-locked for the CUDA driver, of exactly its own size."""
    tensor = torch.zeros(shape, dtype=dtype)
    num_bytes = tensor.numel() * tensor.element_size()
    if num_bytes == 0:
        return tensor
    cudart = torch.cuda.cudart()
    pointer = tensor.data_ptr()
    torch.cuda.check_error(cudart.cudaHostRegister(pointer, num_bytes, 0))
    # Unregistered before the memory goes back to the allocator: weakref callbacks of the
    # tensor run before its storage is freed.
    weakref.finalize(tensor, cudart.cudaHostUnregister, pointer)
    return tensor
