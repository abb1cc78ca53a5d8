"""Work split over processes: tensor parallelism (`kvpool.engine.parallel`: how many ranks,
how long a collective may wait, how finely row-parallel all-reduces overlap the matmuls) and
disaggregated prefill and decode (`kv_transfer_config`: `kvpool.engine.kv_connector`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpool.engine.config.options import option, parse_json_object
from kvpool.engine.kv_connector.config import KVTransferConfig


@dataclass(frozen=True)
class ParallelConfig:
    """`tensor_parallel_size` (vLLM's name) splits the model over that many ranks (rank 0 is
    this process, the others are spawned workers or torchrun's ranks). A collective that waits
    longer than `distributed_timeout_seconds` for a peer fails the step, so a hung worker
    becomes an error, not a hang. `tensor_parallel_overlap_chunks` > 1 all-reduces each
    row-parallel layer's output in that many pieces, each in flight while the next is
    multiplied. What tp > 1 does not support yet is refused by `EngineConfig`, which sees the
    other sections."""

    TITLE: ClassVar[str] = "tensor parallelism and disaggregated serving"

    tensor_parallel_size: int = option(
        1, "split the model over this many ranks (spawned worker processes, or torchrun's "
        "ranks: torchrun --nproc-per-node 2 -m kvpool serve -tp 2)", aliases=("-tp",))
    distributed_timeout_seconds: float = option(
        60.0, "how long a collective waits for a peer before the step fails (a hung worker "
        "becomes an error)")
    tensor_parallel_overlap_chunks: int = option(
        1, "all-reduce each row-parallel layer's output in this many pieces, each in flight "
        "while the next is computed (1: one all-reduce, no overlap)")
    kv_transfer_config: KVTransferConfig | None = option(
        None, 'hand KV between prefill and decode engines, as vLLM does: \'{"kv_connector": '
        '"MooncakeConnector", "kv_role": "kv_producer"}\' (or "kv_consumer"); see '
        "docs/scale-out.md", parser=parse_json_object, metavar="JSON")

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_transfer_config",
                           KVTransferConfig.from_value(self.kv_transfer_config))
        for name in ("tensor_parallel_size", "tensor_parallel_overlap_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.distributed_timeout_seconds > 0:  # also refuses NaN
            raise ValueError("distributed_timeout_seconds must be > 0, got "
                             f"{self.distributed_timeout_seconds}")
