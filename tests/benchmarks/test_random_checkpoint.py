"""A preset written as a HuggingFace directory of random weights is what transformers (and so
vLLM) expects of that architecture: every tensor, by name and shape, and a config it reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from benchmarks.random_checkpoint import (
    fused_as_transformers_names,
    hf_name,
    transformers_shapes,
    write_random_checkpoint,
)
from kvpool.model.llama import checkpoint_shapes
from kvpool.model.loaders.dummy import DRAWN_ELEMENTS, DummyLoader
from kvpool.model.presets import CONFIG_JSON, preset, preset_config_json

# transformers 5 holds an MoE layer's experts fused in memory (converted from the per-expert
# checkpoint names on load), so its state dict cannot be compared with a checkpoint's names.
DENSE_PRESETS = sorted(name for name in CONFIG_JSON if preset(name).moe is None)


@pytest.mark.parametrize("name", DENSE_PRESETS)
def test_every_config_json_preset_has_transformers_tensor_names_and_shapes(name):
    expected = transformers_shapes(preset_config_json(name))
    ours = {hf_name(key): torch.empty(shape, device="meta")
            for key, shape in checkpoint_shapes(preset(name)).items()}
    ours = fused_as_transformers_names(ours, set(expected))
    assert {key: tuple(t.shape) for key, t in ours.items()} == expected


def test_a_written_checkpoint_holds_the_dummy_weights_under_their_hf_names(tmp_path):
    directory = write_random_checkpoint("qwen3-0.6b", tmp_path / "qwen3")
    fields = json.loads((directory / "config.json").read_text())
    assert fields["architectures"] == ["Qwen3ForCausalLM"] and fields["torch_dtype"] == "bfloat16"
    assert not (tmp_path / "qwen3.partial").exists()
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}  # noqa: SIM118
        assert file.get_tensor("model.norm.weight").dtype == torch.bfloat16
        embedding = file.get_tensor("model.embed_tokens.weight")
    # Drawn in full: the rows one repeated block apart differ (the dummy loader's default
    # repeats its block there, and a tied head then has exact ties among its logits).
    period = DRAWN_ELEMENTS // embedding.shape[1]
    assert not torch.equal(embedding[0], embedding[period])
    assert torch.equal(*_tiled_rows(preset("qwen3-0.6b"), period))
    assert shapes == transformers_shapes(fields)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert max(tokenizer("The pool holds every block.")["input_ids"]) < fields["vocab_size"]


def _tiled_rows(config, period: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 0 and `period` of the embedding the dummy loader makes by default."""
    name, embedding = next(DummyLoader(config).iter_weights(config, torch.device("cpu")))
    assert name == "embed_tokens.weight"
    return embedding[0], embedding[period]


def test_a_vocabulary_smaller_than_the_tokenizers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="smaller than SmolLM2's"):
        write_random_checkpoint("tiny", tmp_path / "tiny")
