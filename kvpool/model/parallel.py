"""Tensor parallelism's arithmetic and collectives: which slice of each weight a rank holds.

Megatron-style, as vLLM shards a Llama:

    embedding, LM head   vocab-parallel: rank r holds rows [r V/tp, (r+1) V/tp); the embedding
                         looks up its own rows (zeros elsewhere) and all-reduces; the LM head's
                         partial logits are gathered on rank 0, which alone samples
    q, k, v              column-parallel by heads: rank r computes its query heads and its KV
                         heads, and its KV cache holds only those KV heads
    o_proj, down         row-parallel (split along their input), then one all-reduce each
    gate, up             column-parallel (split along the intermediate size)
    norms                replicated

With fewer KV heads than ranks (GQA), each KV head is replicated on tp / num_kv_heads ranks, as
vLLM does: rank r holds KV head r // (tp / num_kv_heads). The block pool's bookkeeping is single
(rank 0's): block id b is the same block on every rank, each holding its own heads of it.

`TensorParallel.single()` (size 1) is the default everywhere: no process group, no collective,
every slice the whole tensor. `check_shapes` refuses a model tp cannot split, naming the field.
A `ShardSlice` says which part of a full checkpoint tensor a rank needs, so that loaders read
only that part (`kvpool.model.llama.checkpoint_slices`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvpool.model.config import ModelConfig


ShardSlice = tuple[int, slice] | None  # (dimension, its range) of a full tensor; None: all


def take_slice(tensor: torch.Tensor, spec: ShardSlice) -> torch.Tensor:
    """The part `spec` names of a full tensor (a view; the tensor itself for None)."""
    if spec is None:
        return tensor
    dim, span = spec
    return tensor.narrow(dim, span.start, span.stop - span.start)


@dataclass(slots=True)
class CollectiveCounters:
    """What this process's collectives moved and waited, while `enabled` (the tp benchmark
    turns it on): bytes of its own tensors sent into all-reduces and gathers, and seconds
    spent inside them (wall time, so waiting for a slower rank counts too)."""

    enabled: bool = False
    num_calls: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.num_calls, self.num_bytes, self.seconds = 0, 0, 0.0


COLLECTIVES = CollectiveCounters()


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group of `size` ranks."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group, or size 1)
    overlap_chunks: int = 1  # row-parallel matmuls all-reduced in this many pieces (1: whole)

    @classmethod
    def single(cls) -> TensorParallel:
        return cls()

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    # ------------------------------------------------------------ arithmetic
    def shard(self, total: int) -> range:
        """This rank's equal share of `total` (rows of a vocab, intermediate units, heads)."""
        assert total % self.size == 0, f"{total} does not split into {self.size} shares"
        share = total // self.size
        return range(self.rank * share, (self.rank + 1) * share)

    def kv_heads(self, num_kv_heads: int) -> range:
        """The KV heads this rank holds: its share, or with fewer heads than ranks the one
        head it replicates."""
        if num_kv_heads >= self.size:
            return self.shard(num_kv_heads)
        head = self.rank // (self.size // num_kv_heads)
        return range(head, head + 1)

    def num_local_kv_heads(self, num_kv_heads: int) -> int:
        return len(self.kv_heads(num_kv_heads))

    # ------------------------------------------------------------ collectives
    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place (nothing at size 1)."""
        if self.is_parallel:
            import torch.distributed as dist

            start = time.perf_counter()
            dist.all_reduce(tensor, group=self.group)
            _count(tensor, start)
        return tensor

    def row_parallel(self, matmul: Callable[[torch.Tensor], torch.Tensor],
                     x: torch.Tensor) -> torch.Tensor:
        """`matmul(x)` (a row-parallel layer's partial sums) summed over the group.

        With `overlap_chunks` > 1 the rows go in that many pieces and each piece's all-reduce
        is started asynchronously as soon as it is multiplied, so it is in flight while the
        next piece is: communication overlaps compute (the seed's overlap). Rows are
        independent, so the result is the same. `COLLECTIVES.seconds` then counts only the
        time spent waiting for them after the last piece."""
        if not self.is_parallel:
            return matmul(x)
        num_pieces = row_parallel_pieces(x.shape[0], self.overlap_chunks)
        if num_pieces == 1:
            return self.all_reduce_(matmul(x))
        import torch.distributed as dist

        pieces, works = [], []
        for part in x.tensor_split(num_pieces):
            piece = matmul(part)
            works.append(dist.all_reduce(piece, group=self.group, async_op=True))
            pieces.append(piece)
        start = time.perf_counter()
        for work, piece in zip(works, pieces, strict=True):
            work.wait()
            _count(piece, start)
            start = time.perf_counter()
        return torch.cat(pieces)

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `tensor` concatenated along the last dimension, in rank order;
        other ranks: None (they send theirs). At size 1 the tensor itself."""
        if not self.is_parallel:
            return tensor
        import torch.distributed as dist

        start = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(tensor, parts, dst=0, group=self.group)
        _count(tensor, start)
        return torch.cat(parts, dim=-1) if parts is not None else None


def row_parallel_pieces(num_rows: int, overlap_chunks: int) -> int:
    """How many all-reduces `TensorParallel.row_parallel` splits `num_rows` rows into: the
    overlap's pieces when each holds at least two rows, else one."""
    return overlap_chunks if overlap_chunks > 1 and num_rows >= 2 * overlap_chunks else 1


def _count(tensor: torch.Tensor, start: float) -> None:
    if COLLECTIVES.enabled:
        COLLECTIVES.num_calls += 1
        COLLECTIVES.num_bytes += tensor.numel() * tensor.element_size()
        COLLECTIVES.seconds += time.perf_counter() - start


def check_shapes(config: ModelConfig, size: int) -> None:
    """ValueError naming the first model dimension `size` ranks cannot split."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    checks = (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size),
              ("vocab_size", config.vocab_size))
    for name, value in checks:
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} "
                             f"({value})")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} and the model's num_kv_heads ({kv}): one "
                         "must divide the other (KV heads are split, or replicated)")
