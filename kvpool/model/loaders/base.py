"""The `WeightLoader` protocol every weight source implements, and what loading returns.

A loader reads one source (a GGUF file, a HuggingFace directory, random numbers) and answers
four questions: the model's config, its weights as `(checkpoint name, tensor)` pairs, the
tokenizer that goes with them, and its generation config (HF's `generation_config.json`, whose
sampling fields become the engine's request defaults: `kvpool.engine.generation_config`).
Checkpoint names are HuggingFace's without the `model.` prefix (`embed_tokens.weight`,
`layers.3.self_attn.q_proj.weight`, `lm_head.weight`); tensors are yielded one at a time so a
loader never holds the whole model twice. Under tensor parallelism a loader yields only the
rank's part of each tensor (`kvpool.model.llama.checkpoint_slices`), reading no more of the
source than it must.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvpool.model.config import ModelConfig
from kvpool.model.parallel import TensorParallel

if TYPE_CHECKING:
    from kvpool.model.llama import LlamaModel
    from kvpool.model.tokenizer import Tokenizer


class WeightLoader(Protocol):
    """One source of a model's config, weights, tokenizer and generation config."""

    def load_config(self) -> ModelConfig: ...

    def iter_weights(
        self, config: ModelConfig, device: torch.device,
        tp: TensorParallel = TensorParallel.single(),  # noqa: B008 (frozen, immutable)
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint-named tensors in any float dtype, on `device` where that is cheaper:
        for each name, the part `checkpoint_slices(config, tp)` gives (all of it at tp=1)."""
        ...

    def load_tokenizer(self) -> Tokenizer | None: ...

    def load_generation_config(self) -> dict[str, Any]:
        """The source's generation_config.json as a dict; {} when it has none."""
        ...


@dataclass(frozen=True, slots=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer | None  # None for dummy weights: prompts must then be token ids
    load_seconds: float
    generation_config: Mapping[str, Any] = field(default_factory=dict)  # {}: none
