"""Fixtures shared by the whole suite: the real SmolLM2 model, loaded once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct, fp32 on the CPU, as a `LoadedModel`."""
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.setup import load_engine_model

    return load_engine_model(EngineConfig(dtype="float32"))
