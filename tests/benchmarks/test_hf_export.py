"""A GGUF file exported as a HuggingFace directory holds the same weights and tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.hf_export import hf_directory_for
from kvpool.model import default_model_path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import os

    cache = tmp_path_factory.mktemp("cache")
    previous = os.environ.get("KVPOOL_CACHE_DIR")
    os.environ["KVPOOL_CACHE_DIR"] = str(cache)
    try:
        yield hf_directory_for(default_model_path())
    finally:
        if previous is None:
            del os.environ["KVPOOL_CACHE_DIR"]
        else:
            os.environ["KVPOOL_CACHE_DIR"] = previous


def test_the_export_is_a_plain_hf_directory(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # the weights are plain tensors now
    assert (exported / "tokenizer.json").exists() and (exported / "model.safetensors").exists()
    assert hf_directory_for(default_model_path()) == exported  # made once, then reused


def test_the_export_computes_what_the_gguf_computes(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_path()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    copy = AutoModelForCausalLM.from_pretrained(exported)
    text = "The block pool hands out fixed-size blocks."
    ids = AutoTokenizer.from_pretrained(exported)(text, return_tensors="pt").input_ids
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(text).input_ids
    assert ids[0].tolist() == reference
    with torch.inference_mode():
        assert torch.equal(original(ids).logits, copy(ids).logits)
