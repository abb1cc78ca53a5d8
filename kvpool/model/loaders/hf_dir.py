"""Weights, config and tokenizer from a HuggingFace model directory.

Expected: `config.json`, one or more `*.safetensors` files (sharded or not) and, optionally,
tokenizer files and `generation_config.json` (whose `eos_token_id` often lists more stop tokens
than `config.json` does, and whose sampling fields are the model's request defaults). Tensors
stream one at a time from `safetensors.safe_open`, straight onto the target device; under
tensor parallelism only each tensor's slice is read (`get_slice`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvpool.model.config import ModelConfig
from kvpool.model.hf_config import MULTIMODAL_TEXT_DECODERS, config_from_hf
from kvpool.model.parallel import ShardSlice, TensorParallel
from kvpool.model.shard_slices import shard_slice
from kvpool.model.tokenizer import Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Where a multimodal checkpoint keeps its text decoder: the Hub's files (what transformers 5
# writes too), then transformers 5's in-memory names.
_TEXT_DECODER_PREFIXES = ("language_model.model.", "model.language_model.")
# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """`directory`'s generation_config.json as a dict ({} when there is none); ValueError if
    it is not a JSON object."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(content).__name__}")
    return content


class SafetensorsLoader:
    """`WeightLoader` for a HuggingFace model directory."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not is_hf_directory(self.directory):
            raise ValueError(
                f"{self.directory} is not a HuggingFace model directory "
                "(needs config.json and *.safetensors)"
            )
        self.hf_config: dict[str, Any] = json.loads((self.directory / "config.json").read_text())
        self.generation_config = read_generation_config(self.directory)

    def load_config(self) -> ModelConfig:
        config = config_from_hf(self.hf_config)
        extra = self.generation_config.get("eos_token_id")
        if extra is not None:
            extra_ids = [extra] if isinstance(extra, int) else list(extra)
            eos_ids = tuple(dict.fromkeys([*config.eos_token_ids, *extra_ids]))
            config = config.replace(eos_token_ids=eos_ids)
        return config

    def load_generation_config(self) -> dict[str, Any]:
        return dict(self.generation_config)

    def iter_weights(
        self, config: ModelConfig, device: torch.device,
        tp: TensorParallel = TensorParallel.single(),  # noqa: B008 (frozen, immutable)
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for path in sorted(self.directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt", device=str(device)) as file:
                for hf_name in file.keys():  # noqa: SIM118 (safe_open is not a dict)
                    name = self._checkpoint_name(hf_name)
                    if name is None or name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: the embedding matrix is the LM head
                    yield name, _read(file, hf_name, shard_slice(config, tp, name))

    def _checkpoint_name(self, hf_name: str) -> str | None:
        """The model's name for a tensor of this directory; None for a tensor of a multimodal
        checkpoint's other towers (vision encoder, projector), which are not loaded."""
        if self.hf_config.get("model_type") not in MULTIMODAL_TEXT_DECODERS:
            return hf_name.removeprefix("model.")
        for prefix in _TEXT_DECODER_PREFIXES:
            if hf_name.startswith(prefix):
                return hf_name.removeprefix(prefix)
        return "lm_head.weight" if hf_name.endswith("lm_head.weight") else None

    def load_tokenizer(self) -> Tokenizer | None:
        if not any((self.directory / name).is_file() for name in _TOKENIZER_FILES):
            return None
        return Tokenizer.from_pretrained(self.directory, self.load_config().eos_token_ids)


def _read(file: Any, hf_name: str, spec: ShardSlice) -> torch.Tensor:
    """The tensor `hf_name` of an open safetensors file, or only the part `spec` names."""
    if spec is None:
        return file.get_tensor(hf_name)
    dim, span = spec
    index = (slice(None),) * dim + (span,)
    return file.get_slice(hf_name)[index]
