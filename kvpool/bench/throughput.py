"""`kvpool bench throughput`: offline throughput on a fixed, seeded workload, optionally side by
side with other engines (`Baseline`s) on the same model, dtype, prompts and lengths, in one
sitting. The command itself runs kvpool alone; `python -m benchmarks.throughput_baselines` (a
development benchmark, in a checkout) passes vLLM's and transformers' baselines to `run`.

Workload: prompts of random token ids (lengths uniform in `--input-len`), each generating
exactly its own output length (uniform in `--output-len`, EOS ignored, greedy). `--num-prompts
64 32 4` runs the first 64, 32 and 4 prompts of the same seeded workload, each from an empty
prefix cache; `--shared-prefix N` starts every prompt with the same N tokens, to show prefix
caching; `--dtypes float32 bfloat16` repeats everything per dtype, and `--kv-cache-dtypes auto
int8 fp8` everything per KV storage dtype (with `--kv-cache-memory`: the same budget, so a
quantized pool holds more tokens; a baseline runs the same KV dtype where it has one).
`--preemption-modes recompute swap auto` repeats every kvpool run per preemption mode, with the
same `--kv-cache-memory` and `--swap-space`; each run reports its preemptions of each kind, the
blocks and bytes swapped out and in, and its output tokens/s over `recompute`'s. The baselines
preempt their own way: they run once per dtype and KV dtype, next to the first mode.

Each engine also reports its single-request decode latency (ms per token: the time the last
`--latency-tokens` tokens of one request add), and each kvpool run its model FLOP/s next to the
matmul peak measured in the same run (`roofline`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import EngineStats
    from kvpool.engine.llm import LLM

Request = tuple[list[int], int]  # (prompt token ids, output length)
Runs = list[tuple[str, list[Request]]]  # (label, requests), in the order they run


class BaselineUnavailable(RuntimeError):
    """A baseline cannot run (here, or any more); the message says what to set up. Raised by
    `check`, the benchmark stops before measuring anything; by `run`, the report keeps the
    message and the benchmark goes on."""


class Baseline(Protocol):
    """Another engine, run on exactly kvpool's requests right after kvpool, per dtype and KV
    dtype (once per pair, next to the first preemption mode).

    `run` returns `{"runs": {label: {"output_tokens_per_s": ..., ...}}, ...}`; a run that
    carries `token_ids` (one list per request) is compared token by token with kvpool's. The
    rest of the dict is reported as the baseline's own (`decode_ms_per_token`, `load_s` and
    `kv_cache_dtype` are shown in the table when present)."""

    name: str  # the key of its results in the report, e.g. "vllm"
    label: str  # its name in the table, e.g. "vLLM"

    def check(self, config: EngineConfig) -> None:
        """Raise `BaselineUnavailable` if it cannot run on `config`."""

    def run(self, config: EngineConfig, runs: Runs, kv_cache_bytes: int) -> dict:
        """Every run of `runs`; `kv_cache_bytes` is kvpool's KV budget, to match."""


@dataclass(frozen=True, slots=True)
class Workload:
    num_prompts: int = 64
    input_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (64, 256)
    shared_prefix: int = 0
    seed: int = 0

    def requests(self, vocab_size: int) -> list[Request]:
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


def workload_runs(requests: list[Request], counts: list[int]) -> Runs:
    """One run per count: the workload's first `count` requests."""
    return [(str(count), requests[:count]) for count in counts]


def run_kvpool(llm: LLM, runs: Runs, latency_tokens: int, show_progress: bool) -> dict:
    """Each run through `llm` from a clean start (stats zeroed, prefix cache empty)."""
    from kvpool.bench.roofline import workload_flops

    config = llm.engine.model_config
    results = {}
    for label, requests in runs:
        llm.engine.reset_stats()
        result = _generate(llm, requests, show_progress)
        lengths = [(len(prompt), out) for prompt, out in requests]
        flops = workload_flops(config, lengths, result.pop("num_cached_tokens"))
        result["model_gflops_per_s"] = flops / result["elapsed_s"] / 1e9
        results[label] = result
    first_prompt = runs[0][1][0][0]
    return {"runs": results, "decode_ms_per_token": decode_latency(llm, first_prompt,
                                                                   latency_tokens)}


def _generate(llm: LLM, requests: list[Request], show_progress: bool) -> dict:
    from kvpool.engine.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
              for _, output_len in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=show_progress)
    elapsed = time.perf_counter() - start
    token_ids = [list(output.outputs[0].token_ids) for output in outputs]
    num_output = sum(len(tokens) for tokens in token_ids)
    num_prompt = sum(len(prompt) for prompt, _ in requests)
    stats, pool = llm.engine.stats(), llm.memory_stats()
    return {
        **tier_stats(stats),
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_output + num_prompt) / elapsed,
        "num_output_tokens": num_output,
        "num_prompt_tokens": num_prompt,
        "peak_blocks_used": stats.peak_used_blocks,
        "num_blocks": pool.num_blocks,
        "num_steps": stats.num_steps,
        "prefix_cache_hit_tokens": pool.prefix_cache_hits_tokens,
        "step_phase_seconds": stats.phase_seconds,
        "decode_only_model_seconds": stats.decode_only_model_seconds,
        "token_ids": token_ids,
        "num_cached_tokens": [output.num_cached_tokens for output in outputs],
    }


def tier_stats(stats: EngineStats) -> dict:
    """Preemptions of each kind, the KV moved to and from the host tier, and the prompt tokens
    each tier served: what a run's preemption mode and KV tiers did."""
    return {"num_preemptions": stats.num_preemptions, **stats.swap_fields()}


def decode_latency(llm: LLM, prompt: list[int], num_tokens: int, pairs: int = 3) -> float:
    """ms per token of one request's decode: the time `num_tokens` more tokens add to a
    one-token generation (median of `pairs` pairs, each from an empty prefix cache)."""
    def timed(output_len: int) -> float:
        llm.engine.reset_stats()
        return _generate(llm, [(prompt, output_len)], show_progress=False)["elapsed_s"]

    samples = [(timed(num_tokens + 1) - timed(1)) / num_tokens * 1e3 for _ in range(pairs)]
    return statistics.median(samples)


def run_dtype(args: argparse.Namespace, config: EngineConfig, workload: Workload,
              baselines: Sequence[Baseline] = ()) -> dict:
    """One dtype (and KV dtype and preemption mode): kvpool first, then each baseline."""
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM.from_engine(LLMEngine(config))
    load_s = time.perf_counter() - start
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    config = replace(config, dtype=dtype)  # "auto" resolved: the baselines run the same
    runs = workload_runs(workload.requests(llm.engine.model_config.vocab_size), args.num_prompts)
    result = {"dtype": dtype, "kv_cache_dtype": config.cache.kv_cache_dtype,
              "preemption_mode": config.scheduling.preemption_mode,
              "kv_bytes_per_token": llm.engine.kv_memory.layout.bytes_per_token,
              "kvpool": {"load_s": load_s, **run_kvpool(llm, runs, args.latency_tokens,
                                                        not args.json)},
              "baselines": {}}
    kv_cache_bytes = llm.engine.kv_memory.arena.num_reserved_bytes
    del llm
    for baseline in baselines:
        result["baselines"][baseline.name] = baseline.label
        try:
            result[baseline.name] = baseline.run(config, runs, kv_cache_bytes)
        except BaselineUnavailable as error:  # keep what has been measured: report, go on
            result[f"{baseline.name}_error"] = str(error)
    result["comparison"] = compare(result)
    return result


def compare(result: dict) -> dict:
    """Per run: kvpool's output tokens/s over each baseline's (`over_<name>`), and how far
    their tokens agree where the baseline reports them (`tokens_vs_<name>`)."""
    comparison = {}
    for label, ours in result["kvpool"]["runs"].items():
        row = {}
        for name in result["baselines"]:
            if name not in result:
                continue
            theirs = result[name]["runs"][label]
            row[f"over_{name}"] = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
            if "token_ids" in theirs:
                row[f"tokens_vs_{name}"] = compare_tokens(ours["token_ids"], theirs["token_ids"])
        comparison[label] = row
    return comparison


def compare_tokens(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> dict:
    """How far two engines' outputs for the same requests agree: identical requests, and the
    first divergence as (request index, token position), or None when all are identical."""
    first_divergence = None
    identical = 0
    for index, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        if list(mine) == list(other):
            identical += 1
            continue
        pairs = zip(mine, other, strict=False)  # a shorter output diverges where it ends
        position = next((i for i, (a, b) in enumerate(pairs) if a != b),
                        min(len(mine), len(other)))
        if first_divergence is None:
            first_divergence = (index, position)
    return {"identical_requests": identical, "num_requests": len(ours),
            "first_divergence": first_divergence}


def compare_preemption_modes(results: list[dict]) -> None:
    """Add each run's output tokens/s over the `recompute` run of the same dtype and KV dtype
    (`comparison[label]["over_recompute"]`), where one ran."""
    recompute = {(result["dtype"], result["kv_cache_dtype"]): result["kvpool"]["runs"]
                 for result in results if result["preemption_mode"] == "recompute"}
    for result in results:
        reference = recompute.get((result["dtype"], result["kv_cache_dtype"]))
        if reference is None:
            continue
        for label, ours in result["kvpool"]["runs"].items():
            result["comparison"][label]["over_recompute"] = (
                ours["output_tokens_per_s"] / reference[label]["output_tokens_per_s"])


def _without_token_ids(result: dict) -> dict:
    for name in ("kvpool", *result["baselines"]):
        for run in result.get(name, {}).get("runs", {}).values():
            run.pop("token_ids", None)
    return result


def _variant_configs(args: argparse.Namespace, engine_config: EngineConfig) -> list[EngineConfig]:
    """One config per dtype × KV dtype × preemption mode, all built before anything runs: an
    impossible one (swap without --swap-space) fails at once, with nothing measured lost."""
    return [replace(engine_config, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                    preemption_mode=mode)
            for dtype in args.dtypes or [engine_config.load.dtype]
            for kv_cache_dtype in args.kv_cache_dtypes or [engine_config.cache.kv_cache_dtype]
            for mode in args.preemption_modes or [engine_config.scheduling.preemption_mode]]


def run(args: argparse.Namespace, engine_config: EngineConfig,
        baselines: Sequence[Baseline] = ()) -> int:
    """The benchmark of `kvpool bench throughput` (flags: kvpool.cli.bench), on the engine
    `engine_config` describes, each run also through `baselines`; prints a table, or one JSON
    object with `args.json`."""
    from kvpool.bench.roofline import matmul_peak_flops
    from kvpool.bench.throughput_report import format_report

    workload = Workload(
        num_prompts=max(args.num_prompts),
        input_len=tuple(args.input_len),
        output_len=tuple(args.output_len),
        shared_prefix=args.shared_prefix,
        seed=args.workload_seed,
    )
    if min(*workload.input_len, *workload.output_len, *args.num_prompts,
           args.latency_tokens) < 1:
        raise SystemExit("lengths, --num-prompts and --latency-tokens must be at least 1")
    configs = _variant_configs(args, engine_config)
    try:  # before anything runs: fail fast, lose nothing
        for baseline in baselines:
            baseline.check(engine_config)
    except BaselineUnavailable as error:
        raise SystemExit(str(error)) from None
    import torch

    report: dict[str, object] = {
        "workload": asdict(workload),
        "num_prompts": args.num_prompts,
        "matmul_peak_gflops_per_s": {name: matmul_peak_flops(getattr(torch, name)) / 1e9
                                     for name in ("float32", "bfloat16")},
        "preemption_modes": args.preemption_modes,
        "kv_cache_memory": engine_config.cache.kv_cache_memory,
        "num_gpu_blocks": engine_config.cache.num_gpu_blocks,
        "swap_space_gib": engine_config.tiers.swap_space,
        "dtypes": [],
    }
    first_mode = configs[0].scheduling.preemption_mode
    for config in configs:
        # Baselines preempt their own way: they run once, next to the first mode.
        others = baselines if config.scheduling.preemption_mode == first_mode else ()
        report["dtypes"].append(_without_token_ids(run_dtype(args, config, workload, others)))
    compare_preemption_modes(report["dtypes"])
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report) if args.json else format_report(report))
    return 0
