"""Tensor parallelism in the model: sharded shapes, sliced reads, and logits equal to tp=1.

The end-to-end checks spawn real ranks (gloo over TCP, one thread each): each loads its shard,
runs two steps (two prefills, then a decode beside a continued prefill) over a KV cache of its
local heads, and rank 0's logits are compared with the parent's tp=1 run. SmolLM2 (9 query, 3
KV heads) splits only in 3; tiny safetensors checkpoints cover tp=2, untied and tied heads,
q/k/v biases, and one KV head replicated on both ranks. One spawn per world size.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvpool.attention.torch_ref import TorchAttentionBackend
from kvpool.engine.model_runner import ModelRunner, SequenceChunk
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout
from kvpool.model import default_model_path, presets
from kvpool.model.fused_weights import split_fused
from kvpool.model.llama import LlamaModel, checkpoint_slices
from kvpool.model.loaders import load_model
from kvpool.model.loaders.gguf_file import dequantize_tensor, read_slice
from kvpool.model.parallel import TensorParallel, check_shapes, take_slice
from tests.model.hf_checkpoint import save_hf_checkpoint

Q = GGMLQuantizationType
TINY = presets.preset("tiny")  # 4 query heads, 2 KV heads
TINY_CONFIGS = {
    "llama": TINY,
    # One KV head (replicated at tp=2), a tied head, and q/k/v biases.
    "qwen2-gqa": TINY.replace(architecture="qwen2", num_kv_heads=1, tie_word_embeddings=True,
                              attention_bias=True),
}
# Checkpoints written by transformers, for what the configs above cannot say: a mixture of
# experts beside a dense layer, QK-norm, sliding windows, Gemma's norms, Gemma 2's capped
# attention scores, Phi-3's fused qkv_proj and gate_up_proj (split, then sliced) and partial
# rotary (each keeps the shape of tests/model/test_architectures.py, with a vocabulary the
# steps' token ids fit).
HF_KINDS = ("gemma2", "gemma3_text", "qwen3_moe", "phi3")
GGUF_KINDS = {"phi3-gguf": "phi3"}  # llama.cpp's fused attn_qkv and ffn_up: read whole, split
# Two sequences: step 1 prefills both, step 2 decodes the first and continues the second.
STEPS = [
    [SequenceChunk([5, 17, 42, 7, 99, 3], 0, [3, 1]),
     SequenceChunk([11, 250, 8, 64, 2], 0, [2, 4])],
    [SequenceChunk([21], 6, [3, 1]), SequenceChunk([301, 77, 13], 5, [2, 4])],
]


def step_logits(loaded, tp: TensorParallel) -> torch.Tensor | None:
    """Both steps' logits, concatenated (rank 0; None on the others)."""
    config, model = loaded.config, loaded.model
    layout = KVLayout(4, config.num_layers, tp.num_local_kv_heads(config.num_kv_heads),
                      config.head_dim, "float32")
    runner = ModelRunner(model, KVCache(layout, num_blocks=5))
    rows = []
    for chunks in STEPS:
        inputs = runner.prepare(chunks)
        rows.append(model(inputs.token_ids, inputs.positions, runner.kv_step(inputs),
                          inputs.logits_indices))
    return None if rows[0] is None else torch.cat(rows)


def _rank_main(rank: int, size: int, port: int, sources: dict, out_dir: str) -> None:
    """One spawned rank: load each source's shard, run the steps, save what it saw."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=60))
    try:
        tp = TensorParallel(rank, size)
        results = {}
        for key, source in sources.items():
            loaded = load_model(source, "auto", torch.float32, "cpu", tp=tp)  # packed
            results[key] = {"logits": step_logits(loaded, tp), "shapes": _shapes(loaded.model)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _shapes(model) -> dict[str, tuple[int, ...]]:
    """The embedding's shape and each of layer 0's matmuls' (out_features, in_features)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    linears = {"qkv": attn.qkv, "o_proj": attn.o_proj, "lm_head": model.lm_head,
               **({"gate_up": mlp.gate_up, "down": mlp.down} if hasattr(mlp, "down") else {})}
    shapes = {name: (linear.out_features, linear.in_features) for name, linear in linears.items()}
    return {"embed_tokens": tuple(model.embed_tokens.shape), **shapes}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(size: int, sources: dict, out_dir: Path) -> list[dict]:
    """Spawn `size` ranks over `sources` (key -> model path); each rank's results."""
    mp.start_processes(_rank_main, args=(size, _free_port(), sources, str(out_dir)),
                       nprocs=size, start_method="spawn")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(size)]


def tp1_logits(source) -> torch.Tensor:
    # load_model packs the weights (pack_weights), as the ranks do.
    return step_logits(load_model(source, "auto", torch.float32, "cpu"), TensorParallel.single())


def assert_same_logits(sharded: torch.Tensor, reference: torch.Tensor, atol: float) -> None:
    assert sharded.shape == reference.shape and reference.abs().max() > 1.0
    # Row-parallel sums add in another order: fp32 rounding-level differences only.
    torch.testing.assert_close(sharded, reference, atol=atol, rtol=1e-5)
    assert torch.equal(sharded.argmax(-1), reference.argmax(-1))


# ------------------------------------------------------------------ spawned ranks
@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    from tests.model.test_architectures import save_tiny
    from tests.model.test_loaders import write_gguf

    root = tmp_path_factory.mktemp("tp_checkpoints")
    checkpoints = {key: save_hf_checkpoint(root / key, config)
                   for key, config in TINY_CONFIGS.items()}
    for kind in HF_KINDS:
        hf_model = save_tiny(root / kind, kind, vocab_size=512)
        checkpoints[kind] = root / kind
        for key in (key for key, arch in GGUF_KINDS.items() if arch == kind):
            checkpoints[key] = root / f"{key}.gguf"
            with torch.no_grad():
                write_gguf(checkpoints[key], hf_model, arch=kind, qtype=Q.Q8_0)
    return checkpoints


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoints, tmp_path_factory) -> list[dict]:
    sources = {key: str(path) for key, path in tiny_checkpoints.items()}
    return run_ranks(2, sources, tmp_path_factory.mktemp("tp2"))


@pytest.mark.parametrize("key", sorted(TINY_CONFIGS) + sorted(HF_KINDS) + sorted(GGUF_KINDS))
def test_checkpoint_shards_compute_the_tp1_logits(two_ranks, tiny_checkpoints, key):
    assert two_ranks[1][key]["logits"] is None  # only rank 0 gets logits
    assert_same_logits(two_ranks[0][key]["logits"], tp1_logits(tiny_checkpoints[key]), 1e-4)


@pytest.mark.parametrize("key", sorted(TINY_CONFIGS))
def test_each_rank_holds_its_local_shapes(two_ranks, key):
    config = TINY_CONFIGS[key]
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_heads // 2 * head_dim
    kv_size = max(config.num_kv_heads // 2, 1) * head_dim  # one KV head: replicated
    ffn, vocab = config.intermediate_size // 2, config.vocab_size // 2
    expected = {"embed_tokens": (vocab, hidden), "qkv": (q_size + 2 * kv_size, hidden),
                "o_proj": (hidden, q_size), "gate_up": (2 * ffn, hidden), "down": (hidden, ffn),
                "lm_head": (vocab, hidden)}
    assert [results[key]["shapes"] for results in two_ranks] == [expected, expected]


def test_smollm2_gguf_in_three_shards_computes_the_tp1_logits(tmp_path):
    ranks = run_ranks(3, {"smollm2": str(default_model_path())}, tmp_path)
    assert ranks[1]["smollm2"]["logits"] is None and ranks[2]["smollm2"]["logits"] is None
    # Loaded here rather than taken from the session's `smollm2` (slower to set up alone).
    reference = tp1_logits(default_model_path())
    # 30 layers, logits ~25: measured differences up to 1.2e-4.
    assert_same_logits(ranks[0]["smollm2"]["logits"], reference, 1e-3)


# ------------------------------------------------------------------ in one process
def test_check_shapes_names_the_field_tp_cannot_split():
    with pytest.raises(ValueError, match="num_heads"):
        load_model("smollm2-135m", "dummy", tp=TensorParallel(0, 2))  # 9 query heads
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_shapes(TINY.replace(num_heads=12, num_kv_heads=3, head_dim=16), 2)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_shapes(TINY.replace(intermediate_size=130), 4)
    with pytest.raises(ValueError, match="vocab_size"):
        check_shapes(TINY.replace(vocab_size=510), 4)
    with pytest.raises(ValueError, match="num_heads"):
        LlamaModel(TINY, TorchAttentionBackend(), tp=TensorParallel(0, 3))
    check_shapes(TINY.replace(num_kv_heads=1), 4)  # one KV head, replicated


def test_fused_tensors_split_in_their_row_order_and_a_wrong_size_is_named():
    config = TINY.replace(architecture="phi3")  # 4 query heads, 2 KV heads of 16; ffn 128
    (gate_name, gate), (up_name, up) = split_fused(config, "layers.1.mlp.gate_up_proj.weight",
                                                   torch.arange(256.0))
    assert (gate_name, up_name) == ("layers.1.mlp.gate_proj.weight", "layers.1.mlp.up_proj.weight")
    assert gate[-1] == 127 and up[0] == 128
    assert split_fused(config, "layers.1.mlp.up_proj.weight", up) is None  # not fused
    with pytest.raises(ValueError, match=r"'layers.0.self_attn.qkv_proj.weight' has 96 rows, "
                                         r"the model expects 128 \(64 \+ 32 \+ 32"):
        split_fused(config, "layers.0.self_attn.qkv_proj.weight", torch.zeros(96, 64))


def test_checkpoint_slices():
    assert set(checkpoint_slices(TINY).values()) == {None}  # tp=1: every tensor whole
    slices = checkpoint_slices(TINY, TensorParallel(1, 2))
    assert slices["embed_tokens.weight"] == (0, slice(256, 512))
    assert slices["layers.1.self_attn.q_proj.weight"] == (0, slice(32, 64))
    assert slices["layers.1.self_attn.k_proj.weight"] == (0, slice(16, 32))
    assert slices["layers.1.self_attn.o_proj.weight"] == (1, slice(32, 64))
    assert slices["layers.0.mlp.up_proj.weight"] == (0, slice(64, 128))
    assert slices["layers.0.mlp.down_proj.weight"] == (1, slice(64, 128))
    assert slices["layers.0.input_layernorm.weight"] is None
    replicated = checkpoint_slices(TINY_CONFIGS["qwen2-gqa"], TensorParallel(1, 2))
    assert replicated["layers.0.self_attn.v_proj.bias"] is None  # the one KV head, whole
    assert replicated["layers.0.self_attn.q_proj.bias"] == (0, slice(32, 64))


def gguf_tensor(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> SimpleNamespace:
    """A stand-in for gguf's `ReaderTensor`: random weights quantized to `qtype`."""
    weights = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return SimpleNamespace(name="t", tensor_type=qtype, shape=np.array(shape[::-1]),
                           data=quantize(weights, qtype))


@pytest.mark.parametrize("spec", [(1, slice(64, 192)), (1, slice(16, 80)),  # unaligned
                                  (0, slice(2, 5))], ids=["columns", "unaligned", "rows"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.F32], ids=lambda q: q.name)
def test_gguf_slices_read_from_raw_blocks_equal_dequantize_then_slice(qtype, spec):
    tensor = gguf_tensor(qtype, (6, 256))
    assert torch.equal(read_slice(tensor, spec), take_slice(dequantize_tensor(tensor), spec))
    vector = gguf_tensor(qtype, (256,))
    spec = (0, spec[1])
    assert torch.equal(read_slice(vector, spec), take_slice(dequantize_tensor(vector), spec))


def test_dummy_shards_are_local_and_load_without_a_process_group():
    config = TINY_CONFIGS["qwen2-gqa"]
    model = load_model(config, "dummy", tp=TensorParallel(1, 2)).model
    assert model.embed_tokens.shape == (config.vocab_size // 2, config.hidden_size)
    assert model.lm_head.weight is model.embed_tokens  # tied: the same local rows
    qkv = model.layers[0].self_attn.qkv
    assert qkv.out_features == (2 + 2 * 1) * config.head_dim  # 2 query heads, 1 KV head each
    assert model.layers[0].mlp.down.in_features == config.intermediate_size // 2


def test_load_weights_names_a_full_tensor_given_to_a_shard():
    shard = LlamaModel(TINY, TorchAttentionBackend(), tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match=r"expects \(256, 64\) \(rank 0's shard at "
                                         r"tensor_parallel_size 2\)"):
        shard.load_weights([("embed_tokens.weight", torch.zeros(512, 64))])
