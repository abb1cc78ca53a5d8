"""Model-side fixtures: the transformers reference for SmolLM2, loaded once per session.

The kvpool side is the suite-wide `smollm2` fixture, and transformers' model `hf_smollm2` is
suite-wide too (tests/conftest.py: the engine's prompt-logprob tests use it), so each model is
loaded exactly once however many test modules use it.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_tokenizer():
    """transformers' tokenizer built from the same GGUF file."""
    from transformers import AutoTokenizer

    from kvpool.model import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run these tests on one intra-op thread, restored afterwards.

    The model tests issue many small ops (a 135M model, small batches). On a shared, busy
    2-core machine, two OpenMP threads make each op wait for a descheduled thread: measured,
    the mixed-batch greedy test took 82 s with two threads and 11 s with one.
    """
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
