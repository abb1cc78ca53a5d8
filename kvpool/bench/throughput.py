"""`kvpool bench throughput`: offline throughput on a fixed, seeded workload, optionally side by
side with transformers `generate` on the same model, dtype, prompts and lengths.

Workload: `--num-prompts` prompts of random token ids (lengths uniform in `--input-len`),
each generating exactly its own output length (uniform in `--output-len`, EOS ignored, greedy).
`--shared-prefix N` starts every prompt with the same N tokens, to show prefix caching.

Baseline (`--baseline hf`): transformers `generate` over static batches of
`--baseline-batch-size` prompts in arrival order, left-padded; a batch runs until its longest
output is done. Only the tokens each request asked for count as output, so the padding and the
overshoot that static batching pays for are charged to it, as they are in practice.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Workload:
    num_prompts: int = 64
    input_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (64, 256)
    shared_prefix: int = 0
    seed: int = 0

    def requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """(prompt token ids, output length) per request; the same for a given seed."""
        rng = random.Random(self.seed)
        # Ids below 100 hold special tokens in common vocabularies; random text avoids them.
        prefix = [rng.randrange(100, vocab_size) for _ in range(self.shared_prefix)]
        requests = []
        for _ in range(self.num_prompts):
            length = rng.randint(*self.input_len)
            body = [rng.randrange(100, vocab_size) for _ in range(length)]
            requests.append((prefix + body, rng.randint(*self.output_len)))
        return requests


def run_kvpool(
    engine_config: EngineConfig, workload: Workload, show_progress: bool = True
) -> dict[str, object]:
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling_params import SamplingParams

    llm = LLM(**vars(engine_config))
    requests = workload.requests(llm.engine.model_config.vocab_size)
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        for _, output_len in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=show_progress)
    elapsed = time.perf_counter() - start
    num_output = sum(len(output.outputs[0].token_ids) for output in outputs)
    num_prompt = sum(len(prompt) for prompt, _ in requests)
    stats, pool = llm.engine.stats(), llm.memory_stats()
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_output + num_prompt) / elapsed,
        "num_output_tokens": num_output,
        "num_prompt_tokens": num_prompt,
        "peak_blocks_used": stats.peak_used_blocks,
        "num_blocks": pool.num_blocks,
        "num_preemptions": stats.num_preemptions,
        "num_steps": stats.num_steps,
        "prefix_cache_hit_tokens": pool.prefix_cache_hits_tokens,
        "step_phase_seconds": stats.phase_seconds,
        "decode_only_model_seconds": stats.decode_only_model_seconds,
    }


def run_transformers(
    args: argparse.Namespace, engine_config: EngineConfig, workload: Workload
) -> dict[str, object]:
    import torch
    from tqdm.auto import tqdm

    model = load_transformers_model(engine_config)
    requests = workload.requests(model.config.vocab_size)
    batch_size = args.baseline_batch_size
    num_useful = 0
    start = time.perf_counter()
    batches = range(0, len(requests), batch_size)
    for first in tqdm(batches, desc="transformers", unit="batch", disable=args.json):
        batch = requests[first : first + batch_size]
        input_ids, attention_mask = _left_padded([prompt for prompt, _ in batch])
        longest = max(output_len for _, output_len in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        num_useful += sum(output_len for _, output_len in batch)
    elapsed = time.perf_counter() - start
    return {
        "baseline": "hf",
        "baseline_batch_size": batch_size,
        "baseline_elapsed_s": elapsed,
        "baseline_output_tokens_per_s": num_useful / elapsed,
    }


def _left_padded(prompts: list[list[int]]):
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
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from kvpool.model import default_model_path

    dtype = getattr(torch, config.dtype)
    if config.load_format == "dummy":
        from kvpool.bench.generation import load_dummy_hf_model

        return load_dummy_hf_model(config.model, dtype, config.seed, config.device)
    path = Path(config.model) if config.model else default_model_path()
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def format_table(result: dict[str, object]) -> str:
    rows = [
        ("requests / s", result["requests_per_s"]),
        ("output tokens / s", result["output_tokens_per_s"]),
        ("total tokens / s", result["total_tokens_per_s"]),
        ("peak blocks used", result["peak_blocks_used"]),
        ("preemptions", result["num_preemptions"]),
        ("prefix-cache hit tokens", result["prefix_cache_hit_tokens"]),
    ]
    if "baseline_output_tokens_per_s" in result:
        label = f"transformers output tokens / s (batch {result['baseline_batch_size']})"
        rows += [(label, result["baseline_output_tokens_per_s"]), ("speedup", result["speedup"])]
    phases = result["step_phase_seconds"]
    decode_seconds = result["decode_only_model_seconds"]
    for phase, seconds in phases.items():
        rows.append((f"time in {phase}", f"{seconds:.1f} s"))
        if phase == "model":
            rows.append(("  in steps with prefill chunks", f"{seconds - decode_seconds:.1f} s"))
            rows.append(("  in decode-only steps", f"{decode_seconds:.1f} s"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(
        f"{label:<{width}}  {value:,.2f}"
        if isinstance(value, float)
        else f"{label:<{width}}  {value}"
        for label, value in rows
    )


def run(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """The benchmark of `kvpool bench throughput` (flags: kvpool.cli.bench), on the engine
    `engine_config` describes; prints a table, or one JSON object with `args.json`."""
    workload = Workload(
        num_prompts=args.num_prompts,
        input_len=tuple(args.input_len),
        output_len=tuple(args.output_len),
        shared_prefix=args.shared_prefix,
        seed=args.workload_seed,
    )
    if min(*workload.input_len, *workload.output_len, workload.num_prompts) < 1:
        raise SystemExit("lengths and --num-prompts must be at least 1")
    result: dict[str, object] = {
        "workload": asdict(workload),
        **run_kvpool(engine_config, workload, show_progress=not args.json),
    }
    if args.baseline == "hf":
        result.update(run_transformers(args, engine_config, workload))
        result["speedup"] = result["output_tokens_per_s"] / result["baseline_output_tokens_per_s"]
    print(json.dumps(result) if args.json else format_table(result))
    return 0
