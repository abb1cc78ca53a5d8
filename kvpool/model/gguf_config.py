"""`ModelConfig` from GGUF key-values (decoded to Python values) and the file's tensor names.

Keys are `<general.architecture>.<name>`, the names llama.cpp defines. What GGUF does not store
as a key is derived the way llama.cpp derives it: tied embeddings from the absence of
`output.weight`; Qwen3's per-head query/key norms from their tensors; SmolLM3's layers without
RoPE from llama.cpp's fixed interval (every fourth layer: it reads no key for it); Gemma 3's
five sliding layers to one full, its sliding layers' RoPE base (10000) and its attention scale,
all fixed in llama.cpp. Gemma 2 likewise: every second layer full attention (the first
sliding), one RoPE base, attention and final soft-capping always on, with llama.cpp's defaults
(window 4096, caps 50 and 30) where the file has no key.

Phi-3 (`phi3`, llama.cpp's `Phi3MiniModel` converter): the leading `rope.dimension_count`
dimensions of each head rotate (partial rotary); LongRoPE's factors are the tensors
`rope_factors_short.weight` and `rope_factors_long.weight` (given here as `rope_factors`), with
`rope.scaling.original_context_length` and the attention factor the converter computes,
sqrt(1 + ln(s) / ln(original)) for s = context_length / original (transformers' default too),
stored as `rope.scaling.attn_factor`; no `rope.scaling.type` is written. A
`attention.sliding_window` above 0 windows every layer, as transformers does (llama.cpp itself
currently ignores Phi-3's window: llama.cpp#13676). Each position uses the short or the long
factors by itself, as in kvpool's HF runs (`kvpool.model.rope`); llama.cpp instead picks one
set for the whole context from its size.

GGUF's `gemma3` is kvpool's `gemma3_text` (transformers' name for the text decoder). llama.cpp's
converter adds Gemma's 1 to every RMSNorm weight as it writes them, so the file's norms need no
offset (`norm_offset` 0).

Mixtures of experts, as llama.cpp runs them (`src/models/qwen3moe.cpp`, `src/models/llama.cpp`):
`qwen3moe` is kvpool's `qwen3_moe`; `llama` with `expert_count` > 0 is Mixtral. Every layer is
sparse: llama.cpp requires each layer's router and stacked experts and has no `mlp_only_layers`
(a file lacking a layer's router is refused). It always renormalises the top-k weights
(`build_moe_ffn(..., norm_w=true, ...)` for both, whatever `expert_weights_norm` says) after a
softmax over the router logits. Each expert's width is `expert_feed_forward_length` for qwen3moe
(else `feed_forward_length / expert_used_count`, llama.cpp's fallback) and `feed_forward_length`
for Mixtral. Shared experts, a weight scale other than 1 and a gating function other than softmax
are refused by key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from kvpool.model.config import ModelConfig
from kvpool.model.hf_config import UnsupportedFeature
from kvpool.model.layer_spec import MIXTRAL_NAMES, QWEN3_MOE_NAMES, LayerSpec, MoEConfig, RopeSpec

SMOLLM3_NO_ROPE_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for smollm3
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every sixth gemma3 layer is full attention
GEMMA3_SLIDING_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
GEMMA2_SLIDING_PATTERN = 2  # llama.cpp: every second gemma2 layer is full attention
# llama.cpp's gemma2 values where the file has no key: n_swa, and its hparams' cap defaults.
GEMMA2_DEFAULTS = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "gemma2", "gemma3", "qwen3moe",
                 "phi3")
PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS = "rope_factors_short.weight", "rope_factors_long.weight"
# GGUF architecture -> kvpool's (HF model_type); `llama` with experts is `mixtral`.
_KVPOOL_NAMES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
_SOFTMAX_GATING = 1  # gguf.ExpertGatingFuncType.SOFTMAX


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: Collection[str],
                     rope_factors: Mapping[str, Sequence[float]] | None = None) -> ModelConfig:
    """The `ModelConfig` of a GGUF file; `UnsupportedFeature` for an architecture kvpool lacks.
    `rope_factors`: the values of the file's LongRoPE factor tensors (Phi-3), by tensor name."""
    arch = metadata["general.architecture"]
    if arch not in ARCHITECTURES:
        raise UnsupportedFeature(f"unsupported GGUF architecture {arch!r}; supported: "
                                 f"{', '.join(ARCHITECTURES)}")

    def key(suffix: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{suffix}", default)

    moe = _experts(arch, key)
    name = "mixtral" if arch == "llama" and moe is not None else _KVPOOL_NAMES.get(arch, arch)
    config = ModelConfig(architecture=name, **_shared_fields(metadata, key, tensor_names))
    if arch == "gemma3":
        return _gemma3(config, key)
    if arch == "gemma2":
        return _gemma2(config, key)
    if arch == "phi3":
        return _phi3(config, key, rope_factors or {})
    config = _ARCH_FIELDS.get(arch, lambda config, names: config)(config, tensor_names)
    return config if moe is None else _every_layer_sparse(config, moe, tensor_names)


def _shared_fields(metadata: Mapping[str, Any], key: Callable[..., Any],
                   tensor_names: Collection[str]) -> dict[str, Any]:
    num_heads = key("attention.head_count")
    hidden_size = key("embedding_length")
    vocab_size = key("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    eos_keys = ("eos", "eot", "eom")  # end of sequence / of turn / of message
    eos_ids = [metadata.get(f"tokenizer.ggml.{kind}_token_id") for kind in eos_keys]
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv") or num_heads,
        head_dim=key("attention.key_length") or hidden_size // num_heads,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(key),
        max_position_embeddings=key("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
    )


def _qwen2(config: ModelConfig, tensor_names: Collection[str]) -> ModelConfig:
    return config.replace(attention_bias=True)


def _qwen3(config: ModelConfig, tensor_names: Collection[str]) -> ModelConfig:
    return config.replace(qk_norm="blk.0.attn_q_norm.weight" in tensor_names)


def _smollm3(config: ModelConfig, tensor_names: Collection[str]) -> ModelConfig:
    rope = config.rope
    layers = tuple(LayerSpec(None if (i + 1) % SMOLLM3_NO_ROPE_INTERVAL == 0 else rope)
                   for i in range(config.num_layers))
    return config.replace(layers=layers)


def _gemma3(config: ModelConfig, key: Callable[..., Any]) -> ModelConfig:
    full = config.rope
    sliding = RopeSpec(GEMMA3_SLIDING_ROPE_THETA, None, config.head_dim)
    window = key("attention.sliding_window")
    layers = tuple(LayerSpec(full) if (i + 1) % GEMMA3_SLIDING_PATTERN == 0
                   else LayerSpec(sliding, window) for i in range(config.num_layers))
    # llama.cpp scales attention by head_dim ** -0.5, by (hidden / heads) ** -0.5 for the 27B
    # model (62 layers), which is what `query_pre_attn_scalar` says in its config.json.
    scalar = (config.hidden_size // config.num_heads if config.num_layers == 62
              else config.head_dim)
    return config.replace(
        layers=layers, qk_norm=True, hidden_act="gelu_pytorch_tanh", sandwich_norms=True,
        embedding_multiplier=config.hidden_size**0.5, query_pre_attn_scalar=scalar,
        final_logit_softcapping=key("final_logit_softcapping"))


def _gemma2(config: ModelConfig, key: Callable[..., Any]) -> ModelConfig:
    def value(suffix: str) -> Any:
        return key(suffix, GEMMA2_DEFAULTS[suffix])

    rope, window = config.rope, value("attention.sliding_window")
    layers = tuple(LayerSpec(rope) if (i + 1) % GEMMA2_SLIDING_PATTERN == 0
                   else LayerSpec(rope, window) for i in range(config.num_layers))
    # llama.cpp scales attention by head_dim ** -0.5, by (hidden / heads) ** -0.5 for the 27B
    # model (46 layers), as `query_pre_attn_scalar` says in their config.json files.
    scalar = (config.hidden_size // config.num_heads if config.num_layers == 46
              else config.head_dim)
    return config.replace(
        layers=layers, hidden_act="gelu_pytorch_tanh", sandwich_norms=True,
        embedding_multiplier=config.hidden_size**0.5, query_pre_attn_scalar=scalar,
        attn_logit_softcapping=float(value("attn_logit_softcapping")),
        final_logit_softcapping=float(value("final_logit_softcapping")))


def _phi3(config: ModelConfig, key: Callable[..., Any],
          rope_factors: Mapping[str, Sequence[float]]) -> ModelConfig:
    scaling = _longrope(key, rope_factors)
    rope = RopeSpec(config.rope_theta, scaling, key("rope.dimension_count") or config.head_dim)
    window = key("attention.sliding_window") or None  # 0: none (Phi-4-mini)
    layers = tuple(LayerSpec(rope, window) for _ in range(config.num_layers))
    return config.replace(rope_scaling=scaling, layers=layers)


def _longrope(key: Callable[..., Any],
              rope_factors: Mapping[str, Sequence[float]]) -> dict[str, Any] | None:
    """Phi-3's LongRoPE scaling (None without factor tensors: Phi-3-mini-4k); ValueError
    naming what a file with only some of its parts lacks."""
    names = (PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS)
    present = [name for name in names if name in rope_factors]
    if not present:
        return None
    original = key("rope.scaling.original_context_length")
    if len(present) < 2 or not original:
        lacking = [name for name in names if name not in present]
        lacking += [] if original else ["rope.scaling.original_context_length"]
        raise ValueError(f"GGUF phi3 LongRoPE lacks {', '.join(lacking)}")
    scaling = {"rope_type": "longrope", "short_factor": tuple(rope_factors[PHI3_SHORT_FACTORS]),
               "long_factor": tuple(rope_factors[PHI3_LONG_FACTORS]),
               "original_max_position_embeddings": original}
    attention_factor = key("rope.scaling.attn_factor")
    return scaling if attention_factor is None else {**scaling,
                                                     "attention_factor": attention_factor}


def _experts(arch: str, key: Callable[..., Any]) -> MoEConfig | None:
    """The experts of a `qwen3moe` file or of a `llama` one with `expert_count` > 0 (Mixtral);
    None for a dense model. UnsupportedFeature naming a key whose routing kvpool lacks."""
    num_experts = key("expert_count") or 0
    if arch not in ("qwen3moe", "llama") or num_experts == 0:
        if num_experts:
            raise UnsupportedFeature(f"GGUF {arch}.expert_count={num_experts}: experts are "
                                     "implemented for qwen3moe and llama (Mixtral) only")
        return None
    refused = {"expert_shared_count": (None, 0), "expert_weights_scale": (None, 0.0, 1.0),
               "expert_gating_func": (None, _SOFTMAX_GATING)}
    for suffix, accepted in refused.items():
        if key(suffix) not in accepted:
            raise UnsupportedFeature(f"GGUF {arch}.{suffix}={key(suffix)!r} is not supported")
    top_k, ffn = key("expert_used_count"), key("feed_forward_length")
    if arch == "llama":
        return MoEConfig(key("embedding_length"), ffn, num_experts, top_k, norm_topk_prob=True,
                         names=MIXTRAL_NAMES)
    width = key("expert_feed_forward_length") or ffn // top_k
    return MoEConfig(key("embedding_length"), width, num_experts, top_k, norm_topk_prob=True,
                     names=QWEN3_MOE_NAMES)


def _every_layer_sparse(config: ModelConfig, moe: MoEConfig,
                        tensor_names: Collection[str]) -> ModelConfig:
    """`config` with `moe` in every layer, as llama.cpp builds it; UnsupportedFeature for a
    layer without a router (a dense layer, which llama.cpp cannot load either)."""
    dense = [i for i in range(config.num_layers)
             if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    if dense:
        raise UnsupportedFeature(f"GGUF layers {dense} have no experts (blk.N.ffn_gate_inp): "
                                 "dense layers beside sparse ones are not supported in GGUF")
    layers = tuple(dataclasses.replace(spec, sparse_mlp=True) for spec in config.layer_specs)
    return config.replace(moe=moe, layers=layers)


_ARCH_FIELDS: dict[str, Callable[[ModelConfig, Collection[str]], ModelConfig]] = {
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3,
    "smollm3": _smollm3,
}


def _rope_scaling(key: Callable[..., Any]) -> dict[str, Any] | None:
    rope_type = key("rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    if rope_type != "linear":
        raise UnsupportedFeature(f"unsupported GGUF rope scaling {rope_type!r}; "
                                 "supported: linear")
    return {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
