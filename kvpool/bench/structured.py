"""`kvpool bench structured`: what structured outputs cost, as output tokens/s of one batch with
0%, 50% and 100% of its requests constrained by a JSON schema.

Every run is the same work: `num_prompts` chat prompts asking for a product catalogue, each
generating exactly `max_tokens` tokens. Unconstrained requests ignore EOS; the constrained
ones follow a schema whose shortest document (`minItems` products) is longer than
`max_tokens`, so neither kind stops early and every run generates the same tokens. The
schema is compiled before anything is timed (compiling is off the engine's step loop in
serving too), so the runs measure the per-step cost alone: filling the bitmasks, applying
them, and advancing the matchers.

Runs alternate: each round runs every fraction, in reverse order every other round, so a
drift of the machine's speed lands on all of them alike. The report gives each fraction's
median tokens/s over the rounds, its ratio to the unconstrained median, and the sample
phase's milliseconds per step (where the grammar work is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvpool.engine.config import EngineConfig
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.structured_outputs import StructuredOutputsParams

DEFAULT_FRACTIONS = (0.0, 0.5, 1.0)
_MIN_ITEMS = 64  # products the schema requires: far more than any max_tokens allows

CATALOGUE_SCHEMA = {
    "type": "object",
    "properties": {
        "products": {
            "type": "array",
            "minItems": _MIN_ITEMS,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 24},
                    "price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                             "maxItems": 3},
                },
                "required": ["id", "name", "price", "tags"],
            },
        },
    },
    "required": ["products"],
}
_SHOPS = ("a bookshop", "a bakery", "a hardware store", "a florist", "a toy shop",
          "a cheese shop", "a bicycle shop", "a tea house")


def workload_prompts(tokenizer, num_prompts: int) -> list[str]:
    """`num_prompts` chat prompts, each asking for a different shop's catalogue as JSON."""
    prompts = []
    for index in range(num_prompts):
        shop = _SHOPS[index % len(_SHOPS)]
        messages = [{"role": "user", "content": f"List the products of {shop} number "
                     f"{index} as JSON: id, name, price and tags of each."}]
        prompts.append(tokenizer.hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False))
    return prompts


def request_params(num_prompts: int, fraction: float, max_tokens: int,
                   temperature: float) -> list[SamplingParams]:
    """The batch's sampling params: the first round(fraction * num_prompts) constrained."""
    num_constrained = round(fraction * num_prompts)
    spec = StructuredOutputsParams(json=CATALOGUE_SCHEMA)
    return [
        SamplingParams(temperature=temperature, seed=index, max_tokens=max_tokens,
                       ignore_eos=True, structured_outputs=spec if index < num_constrained
                       else None)
        for index in range(num_prompts)
    ]


def run_batch(engine, prompts: list[str], params: list[SamplingParams]) -> dict:
    """Generate the whole batch; its wall time, output tokens and phase seconds."""
    engine.reset_stats()
    start = time.perf_counter()
    for prompt, prompt_params in zip(prompts, params, strict=True):
        engine.add_request(prompt, prompt_params)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {"seconds": seconds, "num_output_tokens": stats.num_generated_tokens,
            "num_steps": stats.num_steps, "sample_seconds": stats.phase_seconds["sample"]}


def run_structured(engine_config: EngineConfig, num_prompts: int, max_tokens: int,
                   fractions: tuple[float, ...], num_rounds: int, temperature: float,
                   warmup: bool = True) -> dict:
    """Every fraction once per round, alternating direction; the summary per fraction."""
    from kvpool.engine.engine import LLMEngine

    engine = LLMEngine(engine_config)
    if engine.grammar_compiler is None:
        raise SystemExit("structured outputs need a model with a tokenizer")
    prompts = workload_prompts(engine.tokenizer, num_prompts)
    batches = {fraction: request_params(num_prompts, fraction, max_tokens, temperature)
               for fraction in fractions}
    engine.grammar_compiler.compile(StructuredOutputsParams(json=CATALOGUE_SCHEMA))
    if warmup:
        run_batch(engine, prompts, batches[max(fractions)])
    runs: dict[float, list[dict]] = {fraction: [] for fraction in fractions}
    for round_index in range(num_rounds):
        order = fractions if round_index % 2 == 0 else tuple(reversed(fractions))
        for fraction in order:
            runs[fraction].append(run_batch(engine, prompts, batches[fraction]))
    engine.close()
    return summarize(runs, num_prompts, max_tokens, temperature)


def summarize(runs: dict[float, list[dict]], num_prompts: int, max_tokens: int,
              temperature: float) -> dict:
    """Median tokens/s per fraction, and each median over the unconstrained one."""
    results = {}
    for fraction, fraction_runs in runs.items():
        rates = [run["num_output_tokens"] / run["seconds"] for run in fraction_runs]
        sample_ms = [run["sample_seconds"] / max(run["num_steps"], 1) * 1e3
                     for run in fraction_runs]
        results[f"{fraction:g}"] = {
            "fraction_constrained": fraction,
            "num_output_tokens": fraction_runs[0]["num_output_tokens"],
            "output_tokens_per_s": statistics.median(rates),
            "output_tokens_per_s_runs": rates,
            "sample_ms_per_step": statistics.median(sample_ms),
        }
    baseline = results.get("0", {}).get("output_tokens_per_s")
    for result in results.values():
        if baseline:
            result["over_unconstrained"] = result["output_tokens_per_s"] / baseline
    return {"num_prompts": num_prompts, "max_tokens": max_tokens, "temperature": temperature,
            "num_rounds": len(next(iter(runs.values()))), "fractions": results}


def format_structured(report: dict) -> str:
    lines = [f"structured outputs: {report['num_prompts']} prompts x {report['max_tokens']} "
             f"tokens, temperature {report['temperature']:g}, median of "
             f"{report['num_rounds']} alternating rounds",
             f"  {'constrained':>11} {'tokens':>7} {'tok/s':>9} {'vs 0%':>7} "
             f"{'sample ms/step':>15}"]
    for result in report["fractions"].values():
        ratio = result.get("over_unconstrained")
        shown = f"{ratio:>6.3f}x" if ratio is not None else f"{'-':>7}"
        lines.append(f"  {result['fraction_constrained']:>10.0%} "
                     f"{result['num_output_tokens']:>7,} {result['output_tokens_per_s']:>9.1f} "
                     f"{shown} {result['sample_ms_per_step']:>15.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """The benchmark of `kvpool bench structured` (flags: kvpool.cli.bench)."""
    fractions = tuple(dict.fromkeys(args.fractions))
    if not all(0 <= fraction <= 1 for fraction in fractions):
        raise SystemExit("--fractions must lie in [0, 1]")
    if min(args.num_prompts, args.max_tokens, args.rounds) < 1:
        raise SystemExit("--num-prompts, --max-tokens and --rounds must be at least 1")
    report = run_structured(engine_config, args.num_prompts, args.max_tokens, fractions,
                            args.rounds, args.temperature, warmup=args.warmup)
    print(json.dumps(report) if args.json else format_structured(report))
    return 0
