"""`kvpool bench kv-trace`: what recording a KV trace (`--kv-trace`) costs, as output tokens/s
of one offline greedy batch with and without it.

Every run is the same work: `--num-prompts` prompts of `--input-len` random token ids
(`kvpool.bench.throughput.Workload`), each generating exactly `--output-len` tokens, EOS
ignored. One engine runs them all, from a reset each time; a traced run attaches a recorder to
it for that run (`KVRecorder.start`, as `EngineConfig.kv_trace` does at start-up) and closes
it at the end, inside the timed span, so the last writes count too. The trace goes to
`--kv-trace FILE` when given (overwritten by each traced run), else to a temporary file.

Runs alternate: untraced then traced, the other way round every other round, so a drift of
the machine's speed lands on both alike. The report gives each mode's median tokens/s over
the rounds, the overhead (1 - traced / untraced), a traced run's trace size in bytes and
lines, and whether both modes generated the same tokens (they must: tracing only observes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvpool.bench.throughput import Workload
from kvpool.engine.config import EngineConfig
from kvpool.engine.sampling_params import SamplingParams

MODES = ("untraced", "traced")


def run_batch(engine, requests: list[tuple[list[int], int]], trace_path: Path | None) -> dict:
    """Generate the whole batch from a reset, traced to `trace_path` when given; its wall time,
    output tokens and every request's token ids."""
    from kvpool.engine.observability.recorder import KVRecorder

    engine.reset_stats()
    start = time.perf_counter()
    if trace_path is not None:
        engine.kv_recorder = KVRecorder.start(str(trace_path), engine.kv_memory)
    ids = [engine.add_request({"prompt_token_ids": prompt},
                              SamplingParams(temperature=0, max_tokens=num_output,
                                             ignore_eos=True)).request_id
           for prompt, num_output in requests]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    if engine.kv_recorder is not None:
        engine.kv_recorder.close()
        engine.kv_recorder = None
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "num_output_tokens": engine.stats().num_generated_tokens,
            "token_ids": [tokens[request_id] for request_id in ids]}


def run_kv_trace(engine_config: EngineConfig, workload: Workload, num_rounds: int,
                 trace_path: Path, warmup: bool = True) -> dict:
    """Each mode once per round, alternating direction; the summary."""
    from kvpool.engine.engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(engine_config, kv_trace=None))
    requests = workload.requests(engine.model_config.vocab_size)
    if warmup:
        run_batch(engine, requests, None)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_index in range(num_rounds):
        order = MODES if round_index % 2 == 0 else MODES[::-1]
        for mode in order:
            runs[mode].append(run_batch(engine, requests,
                                        trace_path if mode == "traced" else None))
    engine.close()
    trace_bytes = trace_path.stat().st_size
    with open(trace_path, encoding="utf-8") as file:
        trace_lines = sum(1 for _ in file)
    return summarize(runs, workload, trace_bytes, trace_lines)


def summarize(runs: dict[str, list[dict]], workload: Workload, trace_bytes: int,
              trace_lines: int) -> dict:
    """Median tokens/s per mode and the overhead of tracing."""
    modes = {}
    for mode, mode_runs in runs.items():
        rates = [run["num_output_tokens"] / run["seconds"] for run in mode_runs]
        modes[mode] = {"output_tokens_per_s": statistics.median(rates),
                       "output_tokens_per_s_runs": rates,
                       "num_output_tokens": mode_runs[0]["num_output_tokens"]}
    token_ids = [run["token_ids"] for mode_runs in runs.values() for run in mode_runs]
    overhead = 1 - modes["traced"]["output_tokens_per_s"] / modes["untraced"][
        "output_tokens_per_s"]
    return {"num_prompts": workload.num_prompts, "input_len": workload.input_len[0],
            "output_len": workload.output_len[0], "num_rounds": len(runs["traced"]),
            "modes": modes, "overhead": overhead, "trace_bytes": trace_bytes,
            "trace_lines": trace_lines,
            "same_tokens": all(ids == token_ids[0] for ids in token_ids)}


def format_kv_trace(report: dict) -> str:
    lines = [f"kv-trace overhead: {report['num_prompts']} prompts x {report['input_len']} "
             f"prompt + {report['output_len']} output tokens, median of "
             f"{report['num_rounds']} alternating rounds",
             f"  {'mode':<9} {'tokens':>8} {'tok/s':>10}  runs"]
    for mode, result in report["modes"].items():
        runs = " ".join(f"{rate:.1f}" for rate in result["output_tokens_per_s_runs"])
        lines.append(f"  {mode:<9} {result['num_output_tokens']:>8,} "
                     f"{result['output_tokens_per_s']:>10.1f}  {runs}")
    lines.append(f"  overhead {report['overhead']:.2%}; trace {report['trace_bytes'] / 2**20:.2f}"
                 f" MiB, {report['trace_lines']:,} lines per run; same tokens: "
                 f"{'yes' if report['same_tokens'] else 'NO'}")
    return "\n".join(lines)


def run(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """The benchmark of `kvpool bench kv-trace` (flags: kvpool.cli.bench)."""
    if min(args.num_prompts, args.input_len, args.output_len, args.rounds) < 1:
        raise SystemExit("--num-prompts, --input-len, --output-len and --rounds must be >= 1")
    workload = Workload(args.num_prompts, (args.input_len,) * 2, (args.output_len,) * 2,
                        seed=args.workload_seed)
    with tempfile.TemporaryDirectory(prefix="kvpool-kv-trace-") as scratch:
        trace_path = Path(engine_config.observability.kv_trace or Path(scratch) / "bench.kv-trace")
        report = run_kv_trace(engine_config, workload, args.rounds, trace_path, args.warmup)
    print(json.dumps(report) if args.json else format_kv_trace(report))
    return 0 if report["same_tokens"] else 1
