"""Engine options, named as in vLLM so users can switch, checked when the config is built."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3  # bytes of KV cache on the CPU when nothing is said
DEFAULT_CHUNKED_BATCHED_TOKENS = 1024
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start.

    KV memory is sized by the first of: `num_gpu_blocks` (a block count), `kv_cache_memory`
    (bytes), or on CUDA `gpu_memory_utilization` (fraction of the device's memory the whole
    process may use, weights included); on the CPU the default is 2 GiB.
    """

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    load_format: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own limit
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    watermark: float = 0.01  # fraction of blocks admission leaves free for running sequences

    def __post_init__(self) -> None:
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "num_gpu_blocks": self.num_gpu_blocks,
            "kv_cache_memory": self.kv_cache_memory,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )

    def batched_tokens_limit(self, max_model_len: int) -> int:
        """Tokens per step: a chunk size with chunked prefill, else room for a whole prompt."""
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    "without chunked prefill, max_num_batched_tokens "
                    f"({self.max_num_batched_tokens}) must be at least max_model_len "
                    f"({max_model_len})"
                )
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return DEFAULT_CHUNKED_BATCHED_TOKENS
        return max(max_model_len, DEFAULT_CHUNKED_BATCHED_TOKENS)
