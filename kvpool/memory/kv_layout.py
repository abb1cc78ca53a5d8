"""The KV layout: the one owner of every fact about how KV is cut into blocks and laid out.

Block size, layer count, KV heads, head dim and KV dtype are decided once, at start-up
(`KVLayout.resolve`, from plain numbers; for a model, `ModelConfig.kv_layout` calls it, so the
memory core never knows the model), and every consumer (block pool, block tables, KV tensors,
model runner, attention metadata, sizing) is handed this object, never a copy of its fields.
Every block count, slot and byte size is a method here, so the formulas exist once:

    slot of token position p   =  block_ids[p // block_size] * block_size + p % block_size
    blocks for n tokens        =  ceil(n / block_size)
    bytes per block            =  num_layers * 2 (K, V) * block_size * num_kv_heads
                                  * (head_dim * element size of dtype
                                     + scale size, if dtype is quantized)

The KV tensor is block-major (see `kvpool.memory.kv_cache`):
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`; `tensor_shape` says so and
`check_tensor` asserts it.

The dtype is the KV *storage* dtype, kept by name so that the pure-Python memory core (block
pool, tables, prefix cache) never imports torch; `torch_dtype` converts. This module owns every
fact about storage dtypes (the `kv_cache_dtype` option's names, element sizes, which dtypes are
quantized and their largest code); `kvpool.memory.kv_quant` owns the quantizer that uses them.
A quantized dtype (int8, fp8) has one float32 scale per (token, KV head) for K and for V, in a
tensor of its own indexed by the same block ids (`scale_tensor_shape`:
`[num_blocks, num_layers, 2, block_size, num_kv_heads]`). Bytes per block include the scales,
so every capacity figure that follows from `bytes_per_block` is honest; `kv_bytes_per_block` is
the K/V codes alone (what the arena holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The `kv_cache_dtype` option (vLLM's names) → the KV storage dtype's torch name; "auto" is
# the model's dtype (`resolve_kv_cache_dtype`).
KV_CACHE_DTYPES = {
    "auto": None,
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "int8": "int8",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
# Bytes per element of each KV storage dtype, by torch's name for it.
KV_DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1,
                  "float8_e5m2": 1}
# Storage dtypes that carry a float32 scale per (token, KV head), K and V apart → the largest
# code magnitude (a row's scale maps its amax onto it).
QUANTIZED_CODE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
SCALE_SIZE = 4  # bytes: scales are float32


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The storage dtype's torch name for a `kv_cache_dtype` option; ValueError, naming the
    choices, for an unknown one. `model_dtype` is the model's torch dtype name."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                         f"got {kv_cache_dtype!r}")
    storage = KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype
    if storage.startswith("float8"):
        import torch

        if not hasattr(torch, storage):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs torch.{storage} "
                             f"(PyTorch >= 2.1); this is PyTorch {torch.__version__}")
    return storage


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-numerator // denominator)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one block of KV is shaped and sized. The pure-Python memory core needs only
    `block_size`, so the other fields default to a one-element block."""

    block_size: int = 16
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dtype not in KV_DTYPE_SIZES:
            raise ValueError(f"KV dtype must be one of {sorted(KV_DTYPE_SIZES)}, got {self.dtype}")

    @classmethod
    def resolve(cls, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                model_dtype: str, kv_cache_dtype: str = "auto") -> KVLayout:
        """The layout of blocks of `block_size` tokens stored as `kv_cache_dtype` ("auto":
        `model_dtype`, a torch dtype name such as "bfloat16")."""
        dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)
        return cls(block_size, num_layers, num_kv_heads, head_dim, dtype)

    # ------------------------------------------------------------ tokens
    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: every block full but the last."""
        return cdiv(num_tokens, self.block_size)

    def max_concurrency(self, num_blocks: int, max_model_len: int) -> float:
        """How many requests of `max_model_len` tokens `num_blocks` blocks hold at once: vLLM's
        "maximum concurrency", KV tokens / max_model_len (shorter requests fit more)."""
        return num_blocks * self.block_size / max_model_len

    def slot(self, block_ids: Sequence[int], position: int) -> int:
        """The KV slot of the token at `position` of a sequence with these blocks."""
        size = self.block_size
        return block_ids[position // size] * size + position % size

    def slot_mapping(self, block_ids: Sequence[int], start: int, end: int) -> list[int]:
        """Slots of positions start..end-1 (a step's new tokens)."""
        size = self.block_size
        return [block_ids[p // size] * size + p % size for p in range(start, end)]

    # ------------------------------------------------------------- bytes
    @property
    def element_size(self) -> int:
        return KV_DTYPE_SIZES[self.dtype]

    @property
    def is_quantized(self) -> bool:
        """Whether K/V are stored as codes with a scale per (token, KV head)."""
        return self.dtype in QUANTIZED_CODE_MAX

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block: `[num_layers, 2, block_size, num_kv_heads, head_dim]`."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_block_shape(self) -> tuple[int, int, int, int]:
        """One block's scales: `[num_layers, 2, block_size, num_kv_heads]`."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K/V codes (every layer), scales excluded."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def scale_bytes_per_token(self) -> int:
        """Bytes of one token's scales (every layer); 0 unless quantized."""
        return self.num_layers * 2 * self.num_kv_heads * SCALE_SIZE if self.is_quantized else 0

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token + self.scale_bytes_per_token

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block's K/V codes: the unit of the arena that holds them."""
        return self.block_size * self.kv_bytes_per_token

    @property
    def scale_bytes_per_block(self) -> int:
        return self.block_size * self.scale_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        """Everything one block costs: K/V codes plus, if quantized, their scales."""
        return self.block_size * self.bytes_per_token

    def num_blocks_for_memory(self, memory_bytes: int) -> int:
        """How many whole blocks a memory budget holds; ValueError if not even one."""
        if memory_bytes < self.bytes_per_block:
            raise ValueError(f"a KV budget of {memory_bytes} bytes cannot hold one block "
                             f"({self.bytes_per_block} bytes)")
        return memory_bytes // self.bytes_per_block

    # ------------------------------------------------------------ tensors
    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`."""
        return (num_blocks, *self.block_shape)

    def scale_tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """`[num_blocks, num_layers, 2, block_size, num_kv_heads]` (quantized layouts)."""
        return (num_blocks, *self.scale_block_shape)

    def check_tensor(self, tensor: torch.Tensor) -> None:
        """Assert that `tensor` is a whole KV cache of this layout (any number of blocks)."""
        assert tuple(tensor.shape[1:]) == self.block_shape, (
            f"KV tensor shape {tuple(tensor.shape)} does not match the layout {self}")
        assert tensor.dtype == self.torch_dtype, f"KV tensor dtype {tensor.dtype} != {self.dtype}"

    def check_scales(self, scales: torch.Tensor | None, num_blocks: int) -> None:
        """Assert that `scales` are this layout's scale tensor for `num_blocks` blocks (None
        exactly when the layout is not quantized)."""
        if not self.is_quantized:
            assert scales is None, f"a {self.dtype} KV cache has no scales"
            return
        import torch

        assert scales is not None, f"a {self.dtype} KV cache needs scales"
        assert tuple(scales.shape) == self.scale_tensor_shape(num_blocks), (
            f"scale tensor shape {tuple(scales.shape)} does not match the layout {self}")
        assert scales.dtype == torch.float32, f"scales must be float32, got {scales.dtype}"
