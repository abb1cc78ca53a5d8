"""The real-shape presets of the newer architectures: each loads with dummy weights in bf16,
runs a step through the paged cache, and keeps no float32 copy of its weights."""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch

from kvpool.model.llama import checkpoint_shapes
from kvpool.model.loaders import load_model
from kvpool.model.presets import PRESETS
from tests.model.test_loaders import kvpool_step_logits

# Loaded and stepped: at most ~2.5 GB of bf16 weights each, so that the suite's two workers
# stay inside the machine's memory whatever runs beside them (the 8B tensor-parallel test
# holds 16 GB). The larger presets are checked by their parameter counts below.
STEPPED_PRESETS = ["llama-3.2-1b", "qwen3-0.6b", "gemma-3-1b"]
# name -> the parameter count its model card gives (billions, as rounded there).
PUBLISHED_PARAMETERS = {"qwen3-4b": 4.0, "smollm3-3b": 3.1, "gemma-3-4b": 3.9,
                        "qwen3-30b-a3b": 30.5, "llama-3.2-1b": 1.2, "qwen3-0.6b": 0.6,
                        "phi-4-mini": 3.8}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.usefixtures("memory_heavy")
@pytest.mark.parametrize("name", STEPPED_PRESETS)
def test_a_real_shape_preset_loads_and_steps_within_its_weights_memory(name):
    config = PRESETS[name]
    weight_bytes = 2 * sum(math.prod(shape) for shape in checkpoint_shapes(config).values())
    gc.collect()
    before = resident_bytes()
    loaded = load_model(name, "dummy", dtype="bfloat16")
    logits = kvpool_step_logits(loaded, list(range(1, 14)), split=[9])
    assert logits.shape == (2, config.vocab_size) and torch.isfinite(logits).all()
    # Weights in bf16, and no float32 copy of them left behind (that alone would be twice
    # them); loose, because the allocator keeps some of what loading freed.
    assert loaded.model.embed_tokens.dtype == torch.bfloat16
    assert resident_bytes() - before < 2 * weight_bytes + (1 << 30)


def test_the_moe_preset_has_qwen3_30b_a3bs_total_and_active_parameters():
    # 30.5B parameters, 3.3B of them active per token (Qwen's model card); 61 GB in bf16, so
    # only its shapes are checked here.
    from kvpool.model.flops import layer_weights

    config = PRESETS["qwen3-30b-a3b"]
    total = sum(math.prod(shape) for shape in checkpoint_shapes(config).values())
    active = (sum(layer_weights(config, i) for i in range(config.num_layers))
              + 2 * config.vocab_size * config.hidden_size)  # embedding and LM head
    assert round(total / 1e9, 1) == 30.5 and abs(active / 1e9 - 3.3) < 0.1
    assert all(layer.sparse_mlp for layer in config.layer_specs)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_a_presets_shapes_hold_its_published_parameter_count(name):
    config = PRESETS[name]
    total = sum(math.prod(shape) for shape in checkpoint_shapes(config).values())
    if config.tie_word_embeddings:  # counted once, as the model cards count it
        assert "lm_head.weight" not in checkpoint_shapes(config)
    assert abs(total / 1e9 - PUBLISHED_PARAMETERS[name]) < 0.06, total



def test_the_phi_4_mini_preset_keeps_its_rotary_longrope_and_exact_size():
    # 7.7 GB in bf16: checked by shape. 3,836,021,760 is the sum of the published
    # checkpoint's tensors (tied: no lm_head), which the model card rounds to 3.8B.
    config = PRESETS["phi-4-mini"]
    assert sum(math.prod(shape) for shape in checkpoint_shapes(config).values()) == 3_836_021_760
    assert config.head_dim == 128 and config.tie_word_embeddings
    rope = config.layer_specs[0].rope
    assert all(spec.rope == rope for spec in config.layer_specs)
    assert rope.rotary_dim == 96 and rope.theta == 10000.0
    scaling = rope.scaling
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 4096
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == rope.rotary_dim // 2


@pytest.mark.usefixtures("memory_heavy")
def test_phi_4_mini_with_two_of_its_layers_loads_and_steps_in_bf16():
    # Every matrix shape of the real model (the 200064-row tied embedding, fused shapes split
    # as they load, 96 rotated dimensions of 128) in 1.6 GB: two of its 32 layers.
    config = PRESETS["phi-4-mini"]
    config = config.replace(num_layers=2, layers=config.layers[:2])
    loaded = load_model(config, "dummy", dtype="bfloat16")
    logits = kvpool_step_logits(loaded, list(range(1, 14)), split=[9])
    assert logits.shape == (2, config.vocab_size) and torch.isfinite(logits).all()
