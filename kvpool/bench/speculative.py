"""`kvpool bench speculative`: output tokens/s with speculative decoding off and on (n-gram
prompt lookup, k drafted tokens per step), in one sitting, on the same greedy requests.

Workloads (`--workloads`): `grounded`, chat prompts whose answers copy from the prompt
(`kvpool.bench.grounded_prompts`: repeat, correct typos, summarise quoting, rename, add a
docstring), each generating up to `--output-len` tokens and stopping at EOS; and `open`, the
throughput benchmark's random-token prompts (`kvpool.bench.throughput.Workload`), each
generating exactly `--output-len` tokens (EOS ignored); and, on request, `chat`, open-ended chat
prompts with nothing to copy (`grounded_prompts.chat_tasks`), stopping at EOS: a model's answer
to random tokens often loops, which prompt lookup finds, so `open` alone overstates what
speculation gains on novel text. Tokens/s counts the tokens each run actually produced, so an
early EOS is never counted as work done.

Concurrency (`--concurrency 1 4 32`): N requests in flight, as a client that sends the next
request as soon as one of its N is answered (`kvpool.bench.closed_loop`): what `max_num_seqs =
N` does with every request queued at once, without an engine per level. Waves of N would
measure less than N, since a wave's stragglers leave the batch short until the wave ends; the
closed loop runs below N only in its tail, and each run reports its mean requests in flight. A
run has `--num-prompts` requests (default: 8N up to 64, and at least 2N and 8), the first of one
seeded list, so every setting and level sees the same prompts. The tail lasts about one
request, so its share of a run is about N / requests: with 2N requests at N = 4, off's
requests (all of one length) ended together while speculation's spread out, and its whole-run
ratio read 0.93× where the steady state read 1.08× (chat, bf16); 32 requests read 1.02× both.

Settings: `off` and `ngram-k{k}` per `--num-speculative-tokens`, each its own engine over ONE
loaded model per dtype (load and start-up excluded from tokens/s; a draft-model setting,
`method: "draft_model"`, joins `speculative_settings` once the engine has one; the engine
flags' `--speculative-config` is replaced by each setting's). Every engine lives for the whole
dtype, each with the engine flags' KV budget (`--kv-cache-memory`), so the settings alternate
within each round (`closed_loop.run_rounds`), each run from an empty prefix cache. A
setting's tokens/s is the median over `--rounds`, its ratio over off the median of the
per-round ratios; acceptance comes from the engine's `stats().spec_decode`; greedy outputs are
compared token for token with off's of the same round (the worst round is reported), and off's
outputs give the share of their 3-grams found in the prompt (how far the workload copies):
`kvpool.bench.speculative_summary`. Tokens/s is reported at N in flight (the run until its
batch first holds fewer than N: the headline) and over the whole run, tail included.

Baselines (engines with no speculation, e.g. vLLM's CPU build) run the grounded workload at
every concurrency after kvpool, per dtype; `python -m benchmarks.speculative_baselines` in a
checkout passes them to `run`, so the user command carries no vLLM code.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tqdm.auto import tqdm

from kvpool.bench.closed_loop import Run, run_closed_loop, run_rounds
from kvpool.bench.speculative_summary import OFF, compare_baseline, summarize
from kvpool.bench.throughput import BaselineUnavailable

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine

WARMUP_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Setting:
    """One configuration measured: its label and `speculative_config` (None: off)."""

    label: str
    speculative_config: dict[str, Any] | None


class Baseline(Protocol):
    """Another engine, without speculation, run on kvpool's grounded runs after kvpool's, per
    dtype, in the same closed loop (`kvpool.bench.closed_loop`). `run` returns `{"runs":
    {run.label: {"steady_output_tokens_per_s_rounds": [...], "output_tokens_per_s_rounds":
    [...], "token_ids": [...]}}, ...}`: `token_ids` (one list per request, of the first round)
    are compared with kvpool's `off`; the rest is reported as the baseline's own."""

    name: str  # the key of its results in the report, e.g. "vllm"
    label: str  # its name in the table, e.g. "vLLM"

    def check(self, config: EngineConfig) -> None:
        """Raise `BaselineUnavailable` if it cannot run on `config`."""

    def run(self, config: EngineConfig, runs: list[Run], num_rounds: int,
            kv_cache_bytes: int) -> dict:
        """Every run of `runs`, each at its concurrency; `kv_cache_bytes` is kvpool's."""


def speculative_settings(num_speculative_tokens: Sequence[int], prompt_lookup_max: int,
                         prompt_lookup_min: int) -> list[Setting]:
    """`off`, then n-gram prompt lookup per k."""
    ngram = [Setting(f"ngram-k{k}", {"method": "ngram", "num_speculative_tokens": k,
                                     "prompt_lookup_max": prompt_lookup_max,
                                     "prompt_lookup_min": prompt_lookup_min})
             for k in dict.fromkeys(num_speculative_tokens)]
    return [Setting(OFF, None), *ngram]


def num_requests(concurrency: int, num_prompts: int | None) -> int:
    """Requests in a run at `concurrency`: `--num-prompts`, else 8 per request in flight up to
    64, at least twice the concurrency and 8 (every grounded task at least once), so the tail
    below N is a small part of the run."""
    if num_prompts is not None:
        return num_prompts
    return max(8, min(8 * concurrency, 64), 2 * concurrency)


def workload_runs(args: argparse.Namespace, engine: LLMEngine) -> tuple[list[Run], dict]:
    """Every (workload, concurrency) run of `args`, and a description of each workload (with a
    fingerprint of its prompts: the grounded passages come from kvpool's own source)."""
    count = max(num_requests(level, args.num_prompts) for level in args.concurrency)
    prompts, info = {}, {}
    for name in args.workloads:
        prompts[name], info[name] = WORKLOAD_PROMPTS[name](args, engine, count)
        info[name]["prompt_lengths"] = [len(prompt) for prompt in prompts[name]]
        info[name]["fingerprint"] = hashlib.sha256(
            json.dumps(prompts[name]).encode()).hexdigest()[:16]
    runs = [Run(name, level, prompts[name][:num_requests(level, args.num_prompts)],
                args.output_len, ignore_eos=info[name]["ignore_eos"])
            for name in args.workloads for level in args.concurrency]
    return runs, info


def _grounded_prompts(args: argparse.Namespace, engine: LLMEngine,
                      count: int) -> tuple[list[list[int]], dict]:
    from kvpool.bench.grounded_prompts import grounded_tasks

    tasks = grounded_tasks(count, args.workload_seed, args.max_passage_chars)
    return _rendered(engine, tasks), {"tasks": [task.kind for task in tasks],
                     "sources": [task.source for task in tasks], "ignore_eos": False}


def _open_prompts(args: argparse.Namespace, engine: LLMEngine,
                  count: int) -> tuple[list[list[int]], dict]:
    from kvpool.bench.throughput import Workload

    workload = Workload(num_prompts=count, input_len=tuple(args.input_len),
                        output_len=(args.output_len, args.output_len), seed=args.workload_seed)
    requests = workload.requests(engine.model_config.vocab_size)
    return [prompt for prompt, _ in requests], {"input_len": args.input_len, "ignore_eos": True}


def _chat_prompts(args: argparse.Namespace, engine: LLMEngine,
                  count: int) -> tuple[list[list[int]], dict]:
    from kvpool.bench.grounded_prompts import chat_tasks

    tasks = chat_tasks(count, args.workload_seed)
    return _rendered(engine, tasks), {"requests": [task.instruction for task in tasks],
                                      "ignore_eos": False}


def _rendered(engine: LLMEngine, tasks: list) -> list[list[int]]:
    from kvpool.bench.grounded_prompts import render_prompts

    try:
        return render_prompts(engine.tokenizer, tasks)
    except ValueError as error:
        raise SystemExit(f"the grounded and chat workloads need the model's chat template "
                         f"({error}); run --workloads open") from None


# --workloads: each builds `count` prompts (token ids) and describes them.
WORKLOAD_PROMPTS = {"grounded": _grounded_prompts, "open": _open_prompts, "chat": _chat_prompts}


def start_engines(config: EngineConfig, settings: Sequence[Setting]) -> tuple[dict, dict]:
    """One engine per setting over one loaded model (each its own, at tensor parallelism > 1),
    and the seconds the load and each start took."""
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.setup import build_engine_parts, load_engine_model

    start = time.perf_counter()
    loaded = load_engine_model(config) if config.parallel.tensor_parallel_size == 1 else None
    seconds = {"load": time.perf_counter() - start}
    engines = {}
    for setting in settings:
        start = time.perf_counter()
        setting_config = replace(config, speculative_config=setting.speculative_config)
        engines[setting.label] = LLMEngine(setting_config,
                                           build_engine_parts(setting_config, loaded))
        seconds[setting.label] = time.perf_counter() - start
    return engines, seconds


def _check_runs(engine: LLMEngine, runs: list[Run], settings: Sequence[Setting]) -> None:
    """Refuse, before measuring, a concurrency the engine cannot hold in one batch or a request
    longer than the model's context (its drafts included)."""
    max_num_seqs = engine.config.scheduling.max_num_seqs
    if max(run.concurrency for run in runs) > max_num_seqs:
        raise SystemExit(f"--concurrency {max(run.concurrency for run in runs)} exceeds "
                         f"--max-num-seqs {max_num_seqs}")
    drafts = max((setting.speculative_config or {}).get("num_speculative_tokens", 0)
                 for setting in settings)
    longest = max(len(prompt) for run in runs for prompt in run.prompts) + runs[0].max_tokens
    if longest + drafts > engine.max_model_len:
        raise SystemExit(f"a request needs {longest + drafts} tokens (prompt, --output-len and "
                         f"{drafts} drafts), over the model's {engine.max_model_len}: shorten "
                         "--input-len, --max-passage-chars or --output-len")


def _warm_up(engines: dict[str, LLMEngine], run: Run) -> None:
    """Two short requests through every engine, untimed: first-use costs land here."""
    short = replace(run, concurrency=2, prompts=run.prompts[:2], max_tokens=WARMUP_TOKENS)
    for engine in engines.values():
        run_closed_loop(engine, short)


def run_dtype(args: argparse.Namespace, config: EngineConfig, settings: Sequence[Setting],
              baselines: Sequence[Baseline] = ()) -> dict:
    """One dtype: every run through every setting, in alternating rounds; then each baseline
    on the grounded runs."""
    engines, seconds = start_engines(config, settings)
    try:
        result, runs = measure(args, engines, settings)
    finally:
        for engine in engines.values():
            engine.close()
        del engines
        gc.collect()  # this dtype's engines and KV memory go before the next dtype's come
    result["start_up_s"] = seconds
    grounded = [run for run in runs if run.workload == "grounded"]
    for baseline in baselines if grounded else ():
        result["baselines"][baseline.name] = baseline.label
        try:
            result[baseline.name] = baseline.run(replace(config, dtype=result["dtype"]),
                                                 grounded, args.rounds,
                                                 result["kv_cache_bytes"])
        except BaselineUnavailable as error:  # keep what kvpool measured: report, go on
            result[f"{baseline.name}_error"] = str(error)
            continue
        compare_baseline(result, baseline.name)
    return result


def measure(args: argparse.Namespace, engines: dict[str, LLMEngine],
            settings: Sequence[Setting]) -> tuple[dict, list[Run]]:
    """Every run of `args` through `engines` (one per setting): the dtype's result, and the
    runs."""
    off = engines[OFF]
    runs, workloads = workload_runs(args, off)
    _check_runs(off, runs, settings)
    if args.warmup:
        _warm_up(engines, runs[0])
    # One tick per workload and concurrency (every setting, every round).
    progress = tqdm(runs, desc=f"{off.dtype}".removeprefix("torch."), unit="run",
                    disable=args.json)
    results = [summarize(run, run_rounds(engines, run, args.rounds)) for run in progress]
    return {"dtype": str(off.dtype).removeprefix("torch."), "workloads": workloads,
            "kv_cache_bytes": off.kv_memory.arena.num_reserved_bytes, "results": results,
            "baselines": {}}, runs


def _without_token_ids(result: dict) -> dict:
    for row in result["results"]:
        row.pop("token_ids_off")
    for name in result["baselines"]:
        for run in result.get(name, {}).get("runs", {}).values():
            run.pop("token_ids", None)
    return result


def _check_args(args: argparse.Namespace) -> None:
    counts = [*args.concurrency, args.output_len, args.rounds, *args.input_len,
              *args.num_speculative_tokens]
    if args.num_prompts is not None:
        counts.append(args.num_prompts)
    if min(counts) < 1:
        raise SystemExit("--concurrency, --output-len, --rounds, --input-len, --num-prompts "
                         "and --num-speculative-tokens must be at least 1")
    if args.num_prompts is not None and args.num_prompts < max(args.concurrency):
        raise SystemExit(f"--num-prompts {args.num_prompts} cannot keep --concurrency "
                         f"{max(args.concurrency)} requests in flight")


def run(args: argparse.Namespace, engine_config: EngineConfig,
        baselines: Sequence[Baseline] = ()) -> int:
    """The benchmark of `kvpool bench speculative` (flags: kvpool.cli.bench), on the engine
    `engine_config` describes; prints a table, or one JSON object with `args.json`."""
    from kvpool.bench.speculative_report import format_report, plot_report

    args.workloads = list(dict.fromkeys(args.workloads))  # each once, in the order given
    args.concurrency = list(dict.fromkeys(args.concurrency))
    _check_args(args)
    settings = speculative_settings(args.num_speculative_tokens, args.prompt_lookup_max,
                                    args.prompt_lookup_min)
    try:  # before anything runs: fail fast, lose nothing
        for setting in settings:
            replace(engine_config, speculative_config=setting.speculative_config)
        for baseline in baselines:
            baseline.check(engine_config)
    except BaselineUnavailable as error:
        raise SystemExit(str(error)) from None
    report: dict[str, Any] = {
        "settings": {setting.label: setting.speculative_config for setting in settings},
        "workloads": args.workloads, "concurrency": args.concurrency,
        "num_prompts": args.num_prompts, "output_len": args.output_len,
        "rounds": args.rounds, "workload_seed": args.workload_seed, "dtypes": [],
    }
    for dtype in args.dtypes or [engine_config.load.dtype]:
        config = replace(engine_config, dtype=dtype)
        report["dtypes"].append(_without_token_ids(run_dtype(args, config, settings,
                                                              baselines)))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot_report(report, args.plot)
    print(json.dumps(report) if args.json else format_report(report))
    return 0
