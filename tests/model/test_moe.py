"""The sparse MoE MLP against transformers' blocks, its routing corners, names and TP shards.

The reference is transformers' own `Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock` (its
eager experts: the plain loop), weights copied into ours through `checkpoint_tensors` from the
block's `state_dict()` (the fused layout) or from the per-expert names transformers' save
writes. Both grouped-expert paths (`torch._grouped_mm` and the loop) are run wherever the
result is compared. Tiny sizes: hidden 32, 8 experts of 16 intermediate units.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from kvpool.model import moe_experts
from kvpool.model.layer_spec import MIXTRAL_NAMES, QWEN3_MOE_NAMES, ExpertNames, MoEConfig
from kvpool.model.moe import (
    GGUF_BLOCK_PART_NAMES,
    SparseMoE,
    checkpoint_slices,
    is_sparse_layer,
    moe_config_from_hf,
    shard_slice,
)
from kvpool.model.moe_experts import group_by_expert
from kvpool.model.parallel import TensorParallel, take_slice
from tests.host_reads import HostReads

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 32, 16, 8
GROUPED_PATHS = [True, False] if moe_experts.has_grouped_mm(torch.empty(0)) else [False]


@pytest.fixture(params=GROUPED_PATHS, ids=lambda g: "grouped_mm" if g else "loop")
def grouped_path(request, monkeypatch):
    """Run the test on one grouped-expert path."""
    monkeypatch.setattr(moe_experts, "has_grouped_mm", lambda x: request.param)
    return request.param


def hf_block(kind: str, top_k: int = 2, norm_topk_prob: bool = True, seed: int = 0):
    """A transformers MoE block with seeded random weights, and our config for it."""
    if kind == "mixtral":
        hf_config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                  num_local_experts=NUM_EXPERTS, num_experts_per_tok=top_k)
        block_class, names, norm_topk_prob = MixtralSparseMoeBlock, MIXTRAL_NAMES, True
    else:
        hf_config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                   num_experts=NUM_EXPERTS, num_experts_per_tok=top_k,
                                   norm_topk_prob=norm_topk_prob)
        block_class, names = Qwen3MoeSparseMoeBlock, QWEN3_MOE_NAMES
    hf_config._experts_implementation = "eager"
    block = block_class(hf_config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    config = MoEConfig(HIDDEN, INTERMEDIATE, NUM_EXPERTS, top_k, norm_topk_prob, names)
    return block, config


def per_expert_state(state: dict[str, torch.Tensor], names: ExpertNames) -> dict:
    """A block's fused `state_dict()` under the Hub's per-expert names (what save writes)."""
    gate, up = state["experts.gate_up_proj"].chunk(2, dim=1)
    out = {f"{names.block}.gate.weight": state["gate.weight"]}
    for e in range(gate.shape[0]):
        prefix = f"{names.block}.experts.{e}."
        out[prefix + f"{names.gate}.weight"] = gate[e]
        out[prefix + f"{names.up}.weight"] = up[e]
        out[prefix + f"{names.down}.weight"] = state["experts.down_proj"][e]
    return out


def checkpoint_from(block, layout: str, names: ExpertNames) -> dict[str, torch.Tensor]:
    state = block.state_dict()
    if layout == "fused":
        return {"mlp." + name: tensor for name, tensor in state.items()}
    if layout == "stacked":
        gate, up = state["experts.gate_up_proj"].chunk(2, dim=1)
        return {"mlp.gate.weight": state["gate.weight"], "mlp.experts.gate_proj.weight": gate,
                "mlp.experts.up_proj.weight": up,
                "mlp.experts.down_proj.weight": state["experts.down_proj"]}
    return per_expert_state(state, names)


@torch.no_grad()
def load(module: SparseMoE, checkpoint: dict[str, torch.Tensor], layout: str = "fused",
         full_config: MoEConfig | None = None) -> SparseMoE:
    """Copy a full checkpoint into `module`, each tensor cut to the rank's slice."""
    targets = module.checkpoint_tensors(layout)
    assert set(targets) == set(checkpoint)
    for name, target in targets.items():
        spec = shard_slice(full_config or module.config, module.tp, name)
        target.copy_(take_slice(checkpoint[name], spec))
    return module


def reference(block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x.unsqueeze(0)).squeeze(0)


# ----------------------------------------------------------------- against transformers
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize(("kind", "top_k", "norm"), [
    ("qwen3_moe", 2, True), ("qwen3_moe", 4, False), ("qwen3_moe", 4, True),
    ("mixtral", 2, True),
])
def test_equals_transformers_block(grouped_path, kind, top_k, norm, num_tokens):
    block, config = hf_block(kind, top_k, norm)
    module = load(SparseMoE(config, torch.float32, "cpu"), checkpoint_from(block, "fused", None))
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    assert (module(x) - reference(block, x)).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_every_layout_loads_the_same_weights(kind, layout):
    block, config = hf_block(kind, top_k=2)
    module = load(SparseMoE(config, torch.float32, "cpu"),
                  checkpoint_from(block, layout, config.names), layout)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert (module(x) - reference(block, x)).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_names_match_what_transformers_saves(tmp_path, kind):
    """transformers 5 keeps experts fused in memory and writes the Hub's per-expert names."""
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    common = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=INTERMEDIATE,
                                                 num_local_experts=NUM_EXPERTS, **common))
        names = MIXTRAL_NAMES
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=INTERMEDIATE,
                                                   num_experts=NUM_EXPERTS, head_dim=16, **common))
        names = QWEN3_MOE_NAMES
    model.save_pretrained(tmp_path)
    block_prefix = f"model.layers.0.{names.block}."
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = {name.removeprefix("model.layers.0."): f.get_slice(name).get_shape()
                 for name in f.keys()  # noqa: SIM118 (safe_open is not a dict)
                 if name.startswith(block_prefix)}
    config = MoEConfig(HIDDEN, INTERMEDIATE, NUM_EXPERTS, 2, True, names)
    ours = SparseMoE(config, torch.float32, "meta").checkpoint_tensors("per_expert")
    assert saved == {name: list(tensor.shape) for name, tensor in ours.items()}


# ------------------------------------------------------------------------- routing corners
def test_group_by_expert_sorts_pairs_by_expert():
    expert_ids = torch.tensor([[3, 0], [0, 2], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])
    groups = group_by_expert(expert_ids, weights, num_experts=5)
    assert groups.token_ids.tolist() == [0, 1, 2, 1, 0, 2]  # expert 0 x3, 2, 3 x2
    assert groups.weights.tolist() == pytest.approx([0.4, 0.9, 0.5, 0.1, 0.6, 0.5])
    assert groups.offsets.tolist() == [3, 3, 4, 6, 6]  # experts 1 and 4: empty runs


def test_idle_experts_are_never_read(grouped_path):
    """All tokens go to experts 0 and 1 (the router says so); the other experts' weights are
    NaN and the output is still finite and equal to transformers'."""
    block, config = hf_block("qwen3_moe", top_k=2)
    with torch.no_grad():
        block.gate.weight[2:] = 0  # logits of 0 for experts 2..7
        block.gate.weight[:2] = block.gate.weight[:2].abs()  # positive inputs pick 0 and 1
    x = torch.rand(16, HIDDEN, generator=torch.Generator().manual_seed(2)) + 1
    expected = reference(block, x)
    with torch.no_grad():
        block.experts.gate_up_proj[2:] = float("nan")
        block.experts.down_proj[2:] = float("nan")
    module = load(SparseMoE(config, torch.float32, "cpu"), checkpoint_from(block, "fused", None))
    out = module(x)
    assert out.isfinite().all()
    assert (out - expected).abs().max() <= 1e-5


def test_all_tokens_to_one_expert(grouped_path):
    """top-1, renormalised: every token's weight is 1 and its output is expert 3's MLP."""
    block, config = hf_block("qwen3_moe", top_k=1, norm_topk_prob=True)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[3] = 1.0
    x = torch.rand(9, HIDDEN, generator=torch.Generator().manual_seed(3)) + 1
    module = load(SparseMoE(config, torch.float32, "cpu"), checkpoint_from(block, "fused", None))
    gate, up = module.w_gate_up[3].chunk(2)
    expert_3 = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ module.w_down[3].T
    assert (module(x) - expert_3).abs().max() <= 1e-5
    assert (module(x) - reference(block, x)).abs().max() <= 1e-5


def test_host_reads_per_layer(grouped_path):
    """grouped_mm reads nothing back to the host; the loop reads the run offsets once."""
    block, config = hf_block("qwen3_moe", top_k=4)
    module = load(SparseMoE(config, torch.float32, "cpu"), checkpoint_from(block, "fused", None))
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(6))
    with HostReads() as reads:
        module(x)
    assert reads.total == (0 if grouped_path else 1)


def test_empty_batch(grouped_path):
    block, config = hf_block("mixtral")
    module = load(SparseMoE(config, torch.float32, "cpu"), checkpoint_from(block, "fused", None))
    assert module(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


# --------------------------------------------------------------------- tensor parallelism
@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_tensor_parallel_partial_sums_add_up(grouped_path, kind, layout):
    """Two ranks' modules, each loaded with only its slices: their partial outputs (what the
    all-reduce sums) add up to the tp=1 output."""
    block, config = hf_block(kind, top_k=2)
    checkpoint = checkpoint_from(block, layout, config.names)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(4))
    whole = load(SparseMoE(config, torch.float32, "cpu"), checkpoint, layout)(x)
    partials = []
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        module = load(SparseMoE(config, torch.float32, "cpu", tp), checkpoint, layout)
        assert module.w_down.shape == (NUM_EXPERTS, HIDDEN, INTERMEDIATE // 2)
        partials.append(module.partial_forward(x))
    assert (partials[0] + partials[1] - whole).abs().max() <= 1e-5


def test_shard_slices_cut_the_intermediate_dimension():
    config = MoEConfig(HIDDEN, INTERMEDIATE, NUM_EXPERTS, 2, True, MIXTRAL_NAMES)
    tp = TensorParallel(1, 2)
    per_expert = checkpoint_slices(config, tp, "per_expert")
    assert per_expert["block_sparse_moe.gate.weight"] is None  # the router is replicated
    assert per_expert["block_sparse_moe.experts.5.w1.weight"] == (0, slice(8, 16))
    assert per_expert["block_sparse_moe.experts.5.w3.weight"] == (0, slice(8, 16))
    assert per_expert["block_sparse_moe.experts.5.w2.weight"] == (1, slice(8, 16))
    stacked = checkpoint_slices(config, tp, "stacked")
    assert stacked["mlp.experts.up_proj.weight"] == (1, slice(8, 16))
    assert stacked["mlp.experts.down_proj.weight"] == (2, slice(8, 16))
    assert all(spec is None for spec in checkpoint_slices(config, TensorParallel()).values())
    assert shard_slice(config, tp, "mlp.experts.5.w9.weight") is None  # load_weights rejects
    with pytest.raises(ValueError, match="fused"):
        shard_slice(config, tp, "mlp.experts.gate_up_proj")
    with pytest.raises(ValueError, match="layout"):
        SparseMoE(config, torch.float32, "meta").checkpoint_tensors("per_layer")


def test_tensor_parallel_refuses_an_indivisible_intermediate_size():
    config = MoEConfig(HIDDEN, 12, NUM_EXPERTS, 2, True)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        SparseMoE(config, torch.float32, "meta", TensorParallel(0, 8))


# -------------------------------------------------------------------------------- bfloat16
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_bfloat16_is_close_to_float32(grouped_path, kind):
    """bf16 weights and inputs: close to the float32 result (not exact), and on average no
    further from it than transformers' own bf16 block (ours sums the experts in float32)."""
    block, config = hf_block(kind, top_k=2)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(5))
    exact = reference(block, x)
    module = load(SparseMoE(config, torch.bfloat16, "cpu"), checkpoint_from(block, "fused", None))
    ours = module(x.bfloat16())
    assert ours.dtype == torch.bfloat16
    theirs = reference(block.to(torch.bfloat16), x.bfloat16())
    our_error, their_error = (ours.float() - exact).abs(), (theirs.float() - exact).abs()
    assert our_error.max() <= 0.02 * exact.abs().max()
    assert our_error.mean() <= 1.1 * their_error.mean()  # measured: 0.92-0.97 of theirs


# ------------------------------------------------------------------------ config and names
def test_gguf_parts_name_the_stacked_layout():
    config = MoEConfig(HIDDEN, INTERMEDIATE, NUM_EXPERTS, 2, True)
    stacked = SparseMoE(config, torch.float32, "meta").checkpoint_tensors("stacked")
    assert {module + ".weight" for module in GGUF_BLOCK_PART_NAMES.values()} == set(stacked)


def test_config_from_hf():
    qwen3 = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
             "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
             "router_aux_loss_coef": 0.001}
    assert moe_config_from_hf(qwen3) == MoEConfig(2048, 768, 128, 8, True)
    assert all(is_sparse_layer(qwen3, i) for i in range(48))
    some_dense = {**qwen3, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert [i for i in range(6) if is_sparse_layer(some_dense, i)] == [1, 5]
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
               "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.1}
    assert moe_config_from_hf(mixtral) == MoEConfig(4096, 14336, 8, 2, True, MIXTRAL_NAMES)
    assert moe_config_from_hf({"model_type": "llama", "hidden_size": 64}) is None


@pytest.mark.parametrize(("hf", "field"), [
    ({"model_type": "qwen2_moe", "num_experts": 60, "shared_expert_intermediate_size": 5632},
     "shared_expert_intermediate_size"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 256}, "deepseek_v3"),
    ({"model_type": "mixtral", "hidden_act": "gelu", "hidden_size": 8}, "hidden_act"),
])
def test_config_refuses_what_is_not_implemented(hf, field):
    with pytest.raises(ValueError, match=field):
        moe_config_from_hf(hf)
