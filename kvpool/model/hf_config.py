"""`ModelConfig` from a HuggingFace `config.json` (as a dict), one reader per `model_type`.

Every reader starts from the fields all these decoders share (`_shared_fields`) and adds its
architecture's own. A config that asks for something kvpool does not implement is refused with
the field's name (`UnsupportedFeature`): never run a model with a silently wrong feature. The
refusals are data (`_REFUSED`: field -> the values kvpool implements), so adding a feature is
deleting its line and implementing it.

transformers 4.x and 5.x spell RoPE differently (`rope_theta` + `rope_scaling`, or one
`rope_parameters` dict); both are read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpool.model.config import ModelConfig
from kvpool.model.layer_spec import LayerSpec, RopeSpec
from kvpool.model.moe import is_sparse_layer, moe_config_from_hf

HFConfig = Mapping[str, Any]


class UnsupportedFeature(ValueError):
    """A model uses a feature kvpool does not implement (the message names the field)."""


# Field -> the values kvpool implements, for every architecture (absent counts as allowed).
_REFUSED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "attention_bias": (False,),  # Llama/Qwen3/SmolLM3 put it on o_proj too
    "use_sliding_window": (False,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "partial_rotary_factor": (1.0,),
}


# Multimodal checkpoints whose text decoder kvpool serves (text in, text out): model_type ->
# the text decoder's model_type, read from the checkpoint's `text_config`.
MULTIMODAL_TEXT_DECODERS = {"gemma3": "gemma3_text"}


def config_from_hf(config: HFConfig) -> ModelConfig:
    """The `ModelConfig` of a HuggingFace `config.json` (of the text decoder, for a multimodal
    checkpoint); `UnsupportedFeature` (a ValueError) naming the field for anything kvpool
    would compute differently."""
    text_type = MULTIMODAL_TEXT_DECODERS.get(config.get("model_type"))
    if text_type is not None:
        shared = {key: config[key] for key in ("tie_word_embeddings",) if key in config}
        config = {**shared, **config.get("text_config", {}), "model_type": text_type}
    model_type = config.get("model_type", "llama")
    reader = _READERS.get(model_type)
    if reader is None:
        raise UnsupportedFeature(f"unsupported architecture {model_type!r} (model_type); "
                                 f"supported: {sorted(_READERS)}")
    fields = reader(config)
    return ModelConfig(architecture=model_type, **fields)


def _check_refused(config: HFConfig,
                   allowed: Mapping[str, tuple[Any, ...] | None] | None = None) -> None:
    """`_REFUSED` with an architecture's own `allowed` values (None: any value)."""
    refused = {**_REFUSED, **(allowed or {})}
    for field, implemented in refused.items():
        value = config.get(field)
        if implemented is not None and value is not None and value not in implemented:
            raise UnsupportedFeature(f"{config.get('model_type')}: {field}={value!r} is not "
                                     f"supported (kvpool implements {list(implemented)})")


def _shared_fields(config: HFConfig) -> dict[str, Any]:
    num_heads = config["num_attention_heads"]
    rope_theta, rope_scaling = hf_rope(config)
    return dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=as_id_tuple(config.get("eos_token_id")),
    )


def _llama(config: HFConfig) -> dict[str, Any]:
    _check_refused(config)
    return _shared_fields(config)


def _mistral(config: HFConfig) -> dict[str, Any]:
    """Mistral and Ministral: Llama whose layers may attend within a sliding window, every
    layer (Mistral 7B v0.1) or those `layer_types` marks (Ministral)."""
    _check_refused(config)
    fields = _shared_fields(config)
    window = config.get("sliding_window")
    if window:
        rope = RopeSpec(fields["rope_theta"], fields["rope_scaling"], fields["head_dim"])
        kinds = config.get("layer_types") or ["sliding_attention"] * fields["num_layers"]
        fields["layers"] = tuple(LayerSpec(rope, window if kind == "sliding_attention" else None)
                                 for kind in kinds)
    return fields


def _qwen2(config: HFConfig) -> dict[str, Any]:
    _check_refused(config, {"attention_bias": (True, False)})  # q/k/v biases, always
    return {**_shared_fields(config), "attention_bias": True}


def _qwen3(config: HFConfig) -> dict[str, Any]:
    _check_refused(config)
    return {**_shared_fields(config), "qk_norm": True}


def _smollm3(config: HFConfig) -> dict[str, Any]:
    """SmolLM3: Llama with no positional encoding in the layers `no_rope_layers` marks 0
    (every fourth by default: transformers derives the list from `no_rope_layer_interval`)."""
    _check_refused(config)
    fields = _shared_fields(config)
    num_layers = fields["num_layers"]
    interval = config.get("no_rope_layer_interval", 4)
    uses_rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0)
                                                 for i in range(num_layers)]
    rope = RopeSpec(fields["rope_theta"], fields["rope_scaling"], fields["head_dim"])
    fields["layers"] = tuple(LayerSpec(rope if use else None) for use in uses_rope)
    return fields


# What Gemma 2 and 3 implement beyond `_REFUSED`: GELU-tanh, either soft-cap, causal attention.
_GEMMA_ALLOWED = {"hidden_act": ("gelu_pytorch_tanh",), "hidden_activation": ("gelu_pytorch_tanh",),
                  "final_logit_softcapping": None, "attn_logit_softcapping": None,
                  "use_bidirectional_attention": (False,)}


def _gemma_numerics(config: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share: RMSNorm scaling by 1 + weight, before and after attention and
    the MLP; GELU-tanh; embeddings × √hidden; optional soft-capping of attention scores and of
    the final logits."""
    return {"hidden_act": "gelu_pytorch_tanh", "sandwich_norms": True, "norm_offset": 1.0,
            "embedding_multiplier": fields["hidden_size"] ** 0.5,
            "final_logit_softcapping": config.get("final_logit_softcapping"),
            "attn_logit_softcapping": config.get("attn_logit_softcapping")}


def _gemma2(config: HFConfig) -> dict[str, Any]:
    """Gemma 2: Gemma's numerics (`_gemma_numerics`), sliding-window and full layers
    alternating (the first sliding, unless `layer_types` says otherwise) with one RoPE, no
    QK-norm, attention scaled by `query_pre_attn_scalar` ** -0.5 (transformers' default 256)."""
    _check_refused(config, _GEMMA_ALLOWED)
    fields = _shared_fields(config)
    rope = RopeSpec(fields["rope_theta"], fields["rope_scaling"], fields["head_dim"])
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(fields["num_layers"])]
    window = config.get("sliding_window")
    layers = tuple(LayerSpec(rope, window if kind == "sliding_attention" else None)
                   for kind in layer_types)
    return {**fields, **_gemma_numerics(config, fields), "layers": layers,
            "query_pre_attn_scalar": config.get("query_pre_attn_scalar", 256)}


def _gemma3_text(config: HFConfig) -> dict[str, Any]:
    """Gemma 3's text decoder: sliding-window layers and full layers (5 : 1 unless
    `layer_types` says otherwise), each kind with its own RoPE; QK-norm; Gemma's numerics
    (`_gemma_numerics`); attention scaled by `query_pre_attn_scalar` ** -0.5."""
    _check_refused(config, _GEMMA_ALLOWED)
    fields = _shared_fields(config)
    num_layers, head_dim = fields["num_layers"], fields["head_dim"]
    pattern = config.get("sliding_window_pattern", 6)
    layer_types = config.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)]
    ropes = _gemma3_ropes(config, head_dim)
    window = config.get("sliding_window")
    fields["layers"] = tuple(
        LayerSpec(ropes[kind], window if kind == "sliding_attention" else None)
        for kind in layer_types)
    full = ropes["full_attention"]
    return {**fields, **_gemma_numerics(config, fields), "rope_theta": full.theta,
            "rope_scaling": full.scaling, "qk_norm": True,
            "query_pre_attn_scalar": config.get("query_pre_attn_scalar", head_dim)}


def _gemma3_ropes(config: HFConfig, head_dim: int) -> dict[str, RopeSpec]:
    """Each layer type's RoPE: transformers 5's `rope_parameters` keyed by layer type, or
    4.x's `rope_theta` + `rope_scaling` (full layers) and `rope_local_base_freq` (sliding)."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        ropes = {}
        for kind, kind_params in params.items():
            theta, scaling = hf_rope({"rope_parameters": kind_params})
            ropes[kind] = RopeSpec(theta, scaling, head_dim)
        return ropes
    theta, scaling = hf_rope(config)
    local_theta = float(config.get("rope_local_base_freq", 10000.0))
    return {"full_attention": RopeSpec(theta, scaling, head_dim),
            "sliding_attention": RopeSpec(local_theta, None, head_dim)}


def _phi3(config: HFConfig) -> dict[str, Any]:
    """Phi-3, Phi-3.5, Phi-4-mini: Llama whose checkpoints fuse q/k/v and gate/up, rotating
    the leading `partial_rotary_factor` of each head (Phi-4-mini: 0.75), with LongRoPE's
    short and long factors; a sliding window on every layer where `sliding_window` is set."""
    _check_refused(config, {"partial_rotary_factor": None})
    fields = _shared_fields(config)
    params = config.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
    scaling = fields["rope_scaling"]
    if scaling is not None:
        scaling = {key: value for key, value in scaling.items() if key != "partial_rotary_factor"}
        if scaling["rope_type"] == "longrope":
            original = scaling.get("original_max_position_embeddings",
                                   config.get("original_max_position_embeddings"))
            scaling["original_max_position_embeddings"] = original
    rope = RopeSpec(fields["rope_theta"], scaling, int(fields["head_dim"] * partial))
    window = config.get("sliding_window")
    layers = tuple(LayerSpec(rope, window) for _ in range(fields["num_layers"]))
    return {**fields, "rope_scaling": scaling, "layers": layers}


def _with_experts(config: HFConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with the model's experts and which layers use them (`kvpool.model.moe`:
    transformers' rule; refuses, by field, the MoE features kvpool lacks)."""
    moe = moe_config_from_hf(dict(config))
    specs = fields.get("layers") or (
        LayerSpec(RopeSpec(fields["rope_theta"], fields["rope_scaling"], fields["head_dim"])),
    ) * fields["num_layers"]
    layers = tuple(dataclasses.replace(spec, sparse_mlp=is_sparse_layer(dict(config), i))
                   for i, spec in enumerate(specs))
    return {**fields, "moe": moe, "layers": layers}


def _qwen3_moe(config: HFConfig) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention; mixtures of experts in the layers `decoder_sparse_step`
    and `mlp_only_layers` leave sparse."""
    return _with_experts(config, _qwen3(config))


def _mixtral(config: HFConfig) -> dict[str, Any]:
    """Mixtral: Mistral's attention (a window where `sliding_window` is set); every layer's MLP
    a mixture of experts."""
    return _with_experts(config, _mistral(config))


_READERS: dict[str, Callable[[HFConfig], dict[str, Any]]] = {
    "phi3": _phi3,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "llama": _llama,
    "mistral": _mistral,
    "ministral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "smollm3": _smollm3,
}


def as_id_tuple(value: int | Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def hf_rope(config: HFConfig) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and rope_scaling from transformers 4.x (`rope_theta` + `rope_scaling`) or
    5.x (`rope_parameters`) config keys."""
    params = dict(config.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = dict(config.get("rope_scaling") or params)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


def plain_hf_config(config: ModelConfig) -> dict[str, Any]:
    """The `config.json` of a `ModelConfig` with no per-layer facts and no feature past Qwen2's
    biases (what tools write beside random weights for transformers or vLLM to load);
    ValueError for anything else, which this short form cannot say."""
    if config.layers or config.rope_scaling is not None or config.architecture not in (
            "llama", "mistral", "qwen2"):
        raise ValueError(f"{config.architecture} with per-layer or scaled RoPE facts has no "
                         "plain config.json form")
    return {
        "model_type": config.architecture, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
    }

