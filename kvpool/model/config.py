"""`ModelConfig`: the shape and numerics of one Llama-family model, read from its weights' metadata.

One config serves every source: GGUF key-values (`from_gguf_metadata`), a HuggingFace
`config.json` (`from_hf_config`), or a named preset (`preset`, for dummy weights and tests).
Llama 2/3, Mistral, SmolLM2 and Qwen2 share the architecture; they differ only in the fields
below (Qwen2 adds q/k/v biases).

Invariants (checked in `__post_init__`): every size is positive, `num_heads` is a multiple of
`num_kv_heads`, `head_dim` is even (rotary embeddings rotate pairs), and `rope_scaling` is None or
a dict whose `rope_type` is one of `ROPE_TYPES` with that type's keys present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.memory.kv_layout import KVLayout

if TYPE_CHECKING:
    import torch

ARCHITECTURES = frozenset({"llama", "mistral", "qwen2"})

# rope_type -> keys it needs. "freq_factors" divides each inverse frequency by a given factor:
# how GGUF files carry Llama 3.1 scaling (a `rope_freqs` tensor instead of key-values).
ROPE_TYPES: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "freq_factors": frozenset({"freq_factors"}),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            known = sorted(ARCHITECTURES)
            raise ValueError(f"unsupported architecture {self.architecture!r}; known: {known}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        for token_id in (*self.eos_token_ids, self.bos_token_id):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"special token id {token_id} outside vocab 0..{self.vocab_size}")
        _check_rope_scaling(self.rope_scaling, self.head_dim)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_layout(self, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> KVLayout:
        """The layout of this model's KV cache with blocks of `block_size` tokens, stored as
        `kv_cache_dtype` ("auto": the model's `dtype`); every KV head (a tensor-parallel rank
        replaces `num_kv_heads` with its share)."""
        return KVLayout.resolve(block_size, self.num_layers, self.num_kv_heads, self.head_dim,
                                str(dtype).removeprefix("torch."), kv_cache_dtype)

    # ------------------------------------------------------------ constructors
    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named model shape (weights come from elsewhere or are random)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """From a HuggingFace `config.json` (as a dict)."""
        model_type = config.get("model_type", "llama")
        if config.get("mlp_bias") or (model_type != "qwen2" and config.get("attention_bias")):
            raise ValueError("biases on o_proj or the MLP are not supported")
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        num_heads = config["num_attention_heads"]
        max_positions = config.get("max_position_embeddings", 4096)
        if config.get("sliding_window") and model_type == "mistral":
            # Full attention equals sliding-window attention up to the window length.
            max_positions = min(max_positions, config["sliding_window"])
        rope_theta, rope_scaling = _hf_rope(config)
        return cls(
            architecture=model_type,
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
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(config.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str]
    ) -> ModelConfig:
        """From GGUF key-values (decoded to Python values) and the file's tensor names.

        Tied embeddings are not a key in GGUF: a file without `output.weight` reuses
        `token_embd.weight` as the LM head.
        """
        arch = metadata["general.architecture"]
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2")

        def key(suffix: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{suffix}", default)

        num_heads = key("attention.head_count")
        hidden_size = key("embedding_length")
        vocab_size = key("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
        eos_keys = ("eos", "eot", "eom")  # end of sequence / of turn / of message
        eos_ids = [metadata.get(f"tokenizer.ggml.{kind}_token_id") for kind in eos_keys]
        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"),
            num_heads=num_heads,
            num_kv_heads=key("attention.head_count_kv") or num_heads,
            head_dim=key("attention.key_length") or hidden_size // num_heads,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(key),
            max_position_embeddings=key("context_length", 4096),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=arch == "qwen2",
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        )

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _as_id_tuple(value: int | Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and rope_scaling from transformers 4.x (`rope_theta` + `rope_scaling`) or
    5.x (`rope_parameters`) config keys."""
    params = dict(config.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = dict(config.get("rope_scaling") or params)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


def _gguf_rope_scaling(key: Any) -> dict[str, Any] | None:
    rope_type = key("rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    if rope_type != "linear":
        raise ValueError(f"unsupported GGUF rope scaling {rope_type!r}; supported: linear")
    return {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}


def _check_rope_scaling(scaling: Mapping[str, Any] | None, head_dim: int) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {sorted(ROPE_TYPES)}")
    missing = ROPE_TYPES[rope_type] - scaling.keys()
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {sorted(missing)}")
    if rope_type == "freq_factors" and len(scaling["freq_factors"]) != head_dim // 2:
        raise ValueError(f"freq_factors needs head_dim / 2 = {head_dim // 2} entries")


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-2-7b": ModelConfig(
        architecture="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "qwen2-0.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True, bos_token_id=151643, eos_token_ids=(151645, 151643),
    ),
}
