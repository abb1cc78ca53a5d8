"""Loading the engine's model: the device a name means, and the weights on it.

The one step that the engine's start-up (`kvpool.engine.setup`, rank 0) and every
tensor-parallel worker (`kvpool.engine.parallel.worker`) share, so both import it from here and
neither imports the other: setup → parallel → model_loading, one way.
"""

from __future__ import annotations

import logging

import torch

from kvpool.attention.selector import get_attention_backend
from kvpool.engine.config import EngineConfig
from kvpool.model.dtype import resolve_dtype
from kvpool.model.loaders.auto import load_model
from kvpool.model.loaders.base import LoadedModel
from kvpool.model.parallel import TensorParallel

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """The device `name` means ("auto": CUDA when there is one, else the CPU); ValueError for
    CUDA asked for where there is none."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    return device


def load_engine_model(config: EngineConfig, tp: TensorParallel | None = None,
                      device: torch.device | None = None) -> LoadedModel:
    """Load the configured model (weights, tokenizer) on the configured device (or
    `device`), in the configured dtype ("auto" decided for that device); with a parallel
    `tp`, only this rank's shard."""
    device = device or resolve_device(config.load.device)
    dtype = resolve_dtype(config.load.dtype, device)
    logger.info("loading the model in %s on %s (dtype=%r)", dtype, device, config.load.dtype)
    shard = {"tp": tp} if tp is not None and tp.is_parallel else {}
    return load_model(
        config.load.model,
        load_format=config.load.load_format,
        dtype=dtype,
        device=device,
        attention_backend=get_attention_backend(config.load.attention_backend, device),
        seed=config.load.seed,
        quantization=config.load.quantization,
        quantization_group_size=config.load.quantization_group_size,
        **shard,
    )
