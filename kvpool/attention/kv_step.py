"""What one step's attention reads and writes, as each layer sees it.

Layer i attends over `layers[i]` (`[num_blocks, 2, block_size, num_kv_heads, head_dim]`, a view
of the KV cache), with `scales[i]` beside it for int8 / fp8 codes, planned by `metadata[i]`.
With one KV cache group every layer shares one plan and its view is `kv[:, i]` of one tensor;
with several (`kvpool.memory.kv_groups`: a sliding-window group beside a full one) each layer
gets its group's view and its group's plan, whose block tables and slots name that group's
blocks. The row structure (which rows are decodes, where each sequence's query starts) is the
batch's, the same in every plan; `plan` is the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class KVStep:
    layers: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor | None, ...]
    metadata: tuple[AttentionMetadata, ...]

    @property
    def plan(self) -> AttentionMetadata:
        """The batch's rows (the same in every layer's plan)."""
        return self.metadata[0]

    @classmethod
    def build(cls, layers: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None],
              plans: Sequence[AttentionMetadata], layer_groups: Sequence[int]) -> KVStep:
        """Layer i's plan is `plans[layer_groups[i]]`."""
        return cls(tuple(layers), tuple(scales), tuple(plans[group] for group in layer_groups))
