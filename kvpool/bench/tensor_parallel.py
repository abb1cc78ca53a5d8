"""`kvpool bench tp`: what tensor parallelism communicates, measured on this machine, and a
paper estimate of what it would cost on H200s (`kvpool.bench.tp_estimate`).

Measured: one greedy batch (`--num-prompts` random prompts of `--input-len` tokens, each
generating exactly `--output-len`, EOS ignored) on an engine with `tensor_parallel_size` 1 and
one with N (`-tp N`, default 2), `--rounds` times each after an untimed warm-up. In the tp = N
runs rank 0's collectives are counted (`kvpool.model.parallel.COLLECTIVES`) step by step, and
each step is classified by the batch the scheduler handed out: decode (every chunk one token)
or prefill. Per kind: calls and bytes per step, and the seconds inside collectives as a share
of the step's wall time (`engine.step()` timed here). Tokens/s of tp = N vs tp = 1 are reported,
not promised: N CPU ranks sharing two cores are not faster than one.

Analytic check, per step of T new tokens and R logits rows (rank 0's own tensors, which is what
the counters count):

    all-reduce bytes = (2 × num_layers + 1) × T × hidden × dtype bytes   (o_proj and down per
                       layer, the vocab-parallel embedding)
    gather bytes     = R × vocab / N × dtype bytes                        (rank 0's LM-head part)

The report says whether every step's measured bytes and calls equal these; the command exits 1
when they do not, or when tp = N generated other tokens than tp = 1 (the GPU check's token
identity). Tokens are compared only for real weights: dummy weights are drawn per rank in its
own shapes, so tp = N and tp = 1 run different models. `--estimate-only` prints only the
paper estimate and starts no engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kvpool.bench.throughput import Workload
from kvpool.bench.tp_estimate import estimate_report, format_estimate
from kvpool.engine.config import EngineConfig
from kvpool.engine.sampling_params import SamplingParams
from kvpool.model.parallel import row_parallel_pieces

DEFAULT_TP_SIZE = 2  # when the engine flags leave -tp at 1
SAME_TOKENS = {True: "yes", False: "NO", None: "not compared (dummy weights differ per tp)"}


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step's batch shape and what rank 0's collectives did in it."""

    is_decode: bool
    num_tokens: int
    num_logits_rows: int
    num_calls: int
    num_bytes: int
    collective_seconds: float
    seconds: float


def expected_step(model_config, tp_size: int, num_tokens: int, num_logits_rows: int,
                  element_size: int, overlap_chunks: int = 1) -> tuple[int, int]:
    """(calls, bytes) rank 0's collectives should count in a step (module docstring); with
    `--tensor-parallel-overlap-chunks` the row-parallel all-reduces go in pieces (more calls,
    the same bytes)."""
    if tp_size == 1:
        return 0, 0
    pieces = row_parallel_pieces(num_tokens, overlap_chunks)
    num_all_reduces = 2 * model_config.num_layers * pieces + 1
    all_reduce = (2 * model_config.num_layers + 1) * num_tokens * model_config.hidden_size * (
        element_size)
    gather = num_logits_rows * model_config.vocab_size // tp_size * element_size
    return num_all_reduces + (num_logits_rows > 0), all_reduce + gather


class _BatchTap:
    """Wraps the scheduler's `schedule` to keep the shape of the batch it last handed out."""

    def __init__(self, schedule: Callable) -> None:
        self._schedule = schedule
        self.num_tokens, self.num_logits_rows, self.is_decode = 0, 0, True

    def __call__(self, *args, **kwargs):
        batch = self._schedule(*args, **kwargs)
        self.num_tokens = sum(chunk.num_new_tokens for chunk in batch.chunks)
        self.num_logits_rows = sum(chunk.num_samples > 0 for chunk in batch.chunks)
        self.is_decode = all(chunk.num_new_tokens == 1 for chunk in batch.chunks)
        return batch


def run_batch(engine, requests: list[tuple[list[int], int]]) -> dict:
    """Generate the batch from a reset, one timed `step()` at a time: wall time, output
    tokens, every request's token ids and a `StepRecord` per step that ran the model."""
    from kvpool.model.parallel import COLLECTIVES

    tap = _BatchTap(engine.scheduler.schedule)
    engine.scheduler.schedule = tap
    engine.reset_stats()
    start = time.perf_counter()
    ids = [engine.add_request({"prompt_token_ids": prompt},
                              SamplingParams(temperature=0, max_tokens=num_output,
                                             ignore_eos=True)).request_id
           for prompt, num_output in requests]
    tokens: dict[str, list[int]] = {}
    steps: list[StepRecord] = []
    try:
        while engine.has_unfinished_requests():
            before = (COLLECTIVES.num_calls, COLLECTIVES.num_bytes, COLLECTIVES.seconds)
            step_start = time.perf_counter()
            for output in engine.step():
                if output.finished:
                    tokens[output.request_id] = list(output.outputs[0].token_ids)
            if tap.num_tokens:
                steps.append(StepRecord(
                    tap.is_decode, tap.num_tokens, tap.num_logits_rows,
                    COLLECTIVES.num_calls - before[0], COLLECTIVES.num_bytes - before[1],
                    COLLECTIVES.seconds - before[2], time.perf_counter() - step_start))
    finally:
        engine.scheduler.schedule = tap._schedule
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "num_output_tokens": engine.stats().num_generated_tokens,
            "token_ids": [tokens[request_id] for request_id in ids], "steps": steps}


def measure(engine_config: EngineConfig, tp_size: int, workload: Workload,
            num_rounds: int) -> dict:
    """`num_rounds` timed runs of the batch on one engine of `tp_size` ranks (after a
    warm-up), rank 0's collectives counted in the timed ones."""
    from kvpool.engine.engine import LLMEngine
    from kvpool.model.parallel import COLLECTIVES

    engine = LLMEngine(dataclasses.replace(engine_config, tensor_parallel_size=tp_size))
    try:
        requests = workload.requests(engine.model_config.vocab_size)
        run_batch(engine, requests)
        COLLECTIVES.reset()
        COLLECTIVES.enabled = True
        runs = [run_batch(engine, requests) for _ in range(num_rounds)]
    finally:
        COLLECTIVES.enabled = False
        engine.close()
    return {"runs": runs, "model_config": engine.model_config,
            "element_size": engine.dtype.itemsize}


def summarize_steps(steps: list[StepRecord], model_config, tp_size: int,
                    element_size: int, overlap_chunks: int = 1) -> dict:
    """Per kind (decode, prefill): steps, calls and bytes per step, the collective share of
    step time, and whether every step matched the analytic expectation."""
    summary = {}
    for kind, is_decode in (("decode", True), ("prefill", False)):
        chosen = [step for step in steps if step.is_decode == is_decode]
        if not chosen:
            continue
        expected = [expected_step(model_config, tp_size, step.num_tokens,
                                  step.num_logits_rows, element_size, overlap_chunks)
                    for step in chosen]
        summary[kind] = {
            "num_steps": len(chosen),
            "tokens_per_step": statistics.mean(step.num_tokens for step in chosen),
            "calls_per_step": statistics.mean(step.num_calls for step in chosen),
            "bytes_per_step": statistics.mean(step.num_bytes for step in chosen),
            "expected_bytes_per_step": statistics.mean(nbytes for _, nbytes in expected),
            "collective_share": sum(step.collective_seconds for step in chosen)
            / sum(step.seconds for step in chosen),
            "matches_expected": all((step.num_calls, step.num_bytes) == pair
                                    for step, pair in zip(chosen, expected, strict=True)),
        }
    return summary


def run_measurement(engine_config: EngineConfig, tp_size: int, workload: Workload,
                    num_rounds: int) -> dict:
    """tp = 1 and tp = `tp_size` on the same batch: tokens/s each, collectives per step."""
    results = {size: measure(engine_config, size, workload, num_rounds)
               for size in (1, tp_size)}
    model_config = results[tp_size]["model_config"]
    element_size = results[tp_size]["element_size"]
    rates = {size: statistics.median(run["num_output_tokens"] / run["seconds"]
                                     for run in result["runs"])
             for size, result in results.items()}
    token_ids = [run["token_ids"] for result in results.values() for run in result["runs"]]
    steps = [step for run in results[tp_size]["runs"] for step in run["steps"]]
    summary = summarize_steps(steps, model_config, tp_size, element_size,
                              engine_config.parallel.tensor_parallel_overlap_chunks)
    return {"tp_size": tp_size, "num_prompts": workload.num_prompts,
            "input_len": workload.input_len[0], "output_len": workload.output_len[0],
            "num_rounds": num_rounds, "dtype_bytes": element_size,
            "output_tokens_per_s": {f"tp{size}": rate for size, rate in rates.items()},
            "speedup": rates[tp_size] / rates[1], "steps": summary,
            "matches_expected": all(kind["matches_expected"] for kind in summary.values()),
            # Dummy weights are drawn per rank in the rank's shapes (kvpool.model.loaders.dummy):
            # tp = N runs other weights than tp = 1, so its tokens prove nothing.
            "same_tokens": None if engine_config.load.load_format == "dummy"
            else all(ids == token_ids[0] for ids in token_ids)}


def format_measurement(report: dict) -> str:
    """The measured half as a table: per step kind, then tokens/s and the checks."""
    tp = report["tp_size"]
    lines = [f"tensor parallel, measured: {report['num_prompts']} prompts x "
             f"{report['input_len']} prompt + {report['output_len']} output tokens, tp={tp} vs "
             f"tp=1, median of {report['num_rounds']} runs, rank 0's collectives",
             f"  {'step':<8} {'steps':>5} {'tokens':>7} {'calls':>6} {'bytes':>12} "
             f"{'expected':>12} {'coll %':>7}  match"]
    for kind, row in report["steps"].items():
        lines.append(f"  {kind:<8} {row['num_steps']:>5} {row['tokens_per_step']:>7.1f} "
                     f"{row['calls_per_step']:>6.1f} {row['bytes_per_step']:>12,.0f} "
                     f"{row['expected_bytes_per_step']:>12,.0f} {row['collective_share']:>7.1%}"
                     f"  {'yes' if row['matches_expected'] else 'NO'}")
    rates = report["output_tokens_per_s"]
    lines.append(f"  output tok/s: tp=1 {rates['tp1']:.1f}, tp={tp} {rates[f'tp{tp}']:.1f} "
                 f"(x{report['speedup']:.2f}); same tokens: "
                 f"{SAME_TOKENS[report['same_tokens']]}")
    return "\n".join(lines)


def run(args: argparse.Namespace, engine_config: EngineConfig | None) -> int:
    """The benchmark of `kvpool bench tp` (flags: kvpool.cli.bench); `engine_config` is None
    with `--estimate-only`."""
    report = {"estimate": estimate_report(tp_sizes=tuple(args.tp_sizes),
                                          batches=tuple(args.batches), context=args.context)}
    text = [format_estimate(report["estimate"])]
    if engine_config is not None:
        if min(args.num_prompts, args.input_len, args.output_len, args.rounds) < 1:
            raise SystemExit("--num-prompts, --input-len, --output-len and --rounds must be >= 1")
        tp_size = engine_config.parallel.tensor_parallel_size
        workload = Workload(args.num_prompts, (args.input_len,) * 2, (args.output_len,) * 2,
                            seed=args.workload_seed)
        measured = run_measurement(engine_config, tp_size if tp_size > 1 else DEFAULT_TP_SIZE,
                                   workload, args.rounds)
        report = {"measured": measured, **report}
        text.insert(0, format_measurement(measured))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report) + "\n", encoding="utf-8")
    print(json.dumps(report) if args.json else "\n\n".join(text))
    measured = report.get("measured")
    passed = measured is None or (measured["same_tokens"] is not False
                                  and measured["matches_expected"])
    return 0 if passed else 1
