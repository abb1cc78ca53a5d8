"""transformers `generate` as the throughput benchmark's baseline (`TransformersBaseline`, a
`kvpool.bench.throughput.Baseline`), on the same weights.

Static batches of `batch_size` prompts in arrival order, left-padded; a batch runs until its
longest output is done. Only the tokens each request asked for count as output, so the padding
and the overshoot that static batching pays for are charged to it, as they are in practice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvpool.engine.config import EngineConfig

Request = tuple[list[int], int]  # (prompt token ids, output length)


@dataclass(frozen=True)
class TransformersBaseline:
    """`generate` in static batches of `batch_size`; any model kvpool loads, dummy included."""

    batch_size: int
    show_progress: bool
    name: str = "hf"
    label: str = "transformers"

    def check(self, config: EngineConfig) -> None:
        """transformers loads whatever kvpool loads: nothing to check up front."""

    def run(self, config: EngineConfig, runs: Sequence[tuple[str, Sequence[Request]]],
            kv_cache_bytes: int) -> dict:
        return run_transformers(config, runs, self.batch_size, self.show_progress)


def run_transformers(config: EngineConfig, runs: Sequence[tuple[str, Sequence[Request]]],
                     batch_size: int, show_progress: bool) -> dict:
    """Each (label, requests) run through transformers; output tokens/s per label."""
    from tqdm.auto import tqdm

    model = load_transformers_model(config)
    results = {}
    for label, requests in runs:
        batches = range(0, len(requests), batch_size)
        start = time.perf_counter()
        for first in tqdm(batches, desc=f"transformers {label}", unit="batch",
                          disable=not show_progress):
            _generate_batch(model, requests[first : first + batch_size])
        elapsed = time.perf_counter() - start
        num_useful = sum(output_len for _, output_len in requests)
        results[label] = {"elapsed_s": elapsed, "output_tokens_per_s": num_useful / elapsed}
    return {"batch_size": batch_size, "runs": results}


def _generate_batch(model, batch: Sequence[Request]) -> None:
    import torch

    input_ids, attention_mask = _left_padded([prompt for prompt, _ in batch])
    longest = max(output_len for _, output_len in batch)
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=attention_mask,
                       max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=0)


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def load_transformers_model(config: EngineConfig):
    """The same weights in transformers: the GGUF file or HF directory kvpool loads, or the
    same seeded dummy weights."""
    from transformers import AutoModelForCausalLM

    from kvpool.engine.setup import resolve_device
    from kvpool.model import default_model_path
    from kvpool.model.dtype import resolve_dtype

    dtype = resolve_dtype(config.load.dtype, resolve_device(config.load.device))
    if config.load.load_format == "dummy":
        from benchmarks.generation import load_dummy_hf_model

        return load_dummy_hf_model(config.load.model, dtype, config.load.seed, config.load.device)
    path = Path(config.load.model) if config.load.model else default_model_path()
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()
