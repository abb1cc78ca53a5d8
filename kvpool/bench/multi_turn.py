"""`kvpool bench multi-turn`: chat conversations that resend their whole history every turn,
to measure what the KV tiers below the device pool save.

Workload (seeded, random token ids ≥ 100): `--num-conversations` conversations share one system
prompt of `--system-prompt-len` tokens and have `--num-turns` turns each. A turn's prompt is the
conversation so far (the system prompt, then every earlier turn's user tokens and the output the
engine produced for them) plus the turn's `--user-len` new user tokens; it generates exactly
`--output-len` tokens (greedy, EOS ignored). All conversations run at once, in a closed loop: a
conversation's next turn is submitted as soon as its previous turn finishes.

Configurations (`--tiers`), one after another, each on a fresh engine over ONE loaded model:
`off` (the device pool alone), `host` (`--swap-space` GiB of host tier), `disk` (a disk tier in
an empty directory), `host+disk`, and `disk-restart`: a new engine over the directory `disk`
left behind, as after a restart (the same conversations again find their turns on disk). The
device pool is small (`--kv-cache-memory`, 64 MiB by default) so that histories do not stay on
the device: a tier that keeps them turns a long prompt's prefill into a copy, which the time to
first token (TTFT) of later turns shows. The same prompts decoded greedily must give the same
tokens in every configuration; the report says whether they did (`outputs_identical`) rather
than asserting it. Before the timed configurations the whole workload runs once, untimed, in
the first one (`--no-warmup-pass` skips it), so that first-use costs do not favour the
configurations that run later.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine
    from kvpool.model.loaders.base import LoadedModel

TIERS = ("off", "host", "disk", "host+disk", "disk-restart")
RESTART = "disk-restart"  # reuses the directory of "disk", which must run before it
DEFAULT_KV_CACHE_MEMORY = 64 * 2**20  # small enough that the histories leave the device
DEFAULT_SWAP_SPACE_GIB = 1.0


@dataclass(frozen=True, slots=True)
class Conversations:
    """The seeded multi-turn workload: the same token ids for the same fields."""

    num_conversations: int = 8
    num_turns: int = 4
    system_prompt_len: int = 2048
    user_len: int = 64
    output_len: int = 64
    seed: int = 0

    def user_tokens(self, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
        """The shared system prompt, and each conversation's new user tokens per turn."""
        rng = random.Random(self.seed)

        def draw(length: int) -> list[int]:
            # Ids below 100 hold special tokens in common vocabularies; random text avoids them.
            return [rng.randrange(100, vocab_size) for _ in range(length)]

        system = draw(self.system_prompt_len)
        users = [[draw(self.user_len) for _ in range(self.num_turns)]
                 for _ in range(self.num_conversations)]
        return system, users

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus output of a conversation's last turn: its longest sequence."""
        return self.system_prompt_len + self.num_turns * (self.user_len + self.output_len)


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished turn: its place, its prompt, what the prefix cache served, TTFT, tokens."""

    conversation: int
    turn: int  # 0 is the first
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    token_ids: list[int]


def tier_config(base: EngineConfig, tier: str, disk_dir: str) -> EngineConfig:
    """`base` with the tiers `tier` names: the host tier keeps `base.tiers.swap_space`, the disk
    tier lives in `disk_dir`."""
    return replace(base, swap_space=base.tiers.swap_space if "host" in tier else 0.0,
                   kv_disk_cache=disk_dir if "disk" in tier else None)


def run_conversations(engine: LLMEngine, workload: Conversations, label: str,
                      show_progress: bool) -> list[Turn]:
    """Every conversation to its last turn, closed loop; the turns in the order they ended."""
    from tqdm.auto import tqdm

    from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams

    system, users = workload.user_tokens(engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    histories = [list(system) for _ in range(workload.num_conversations)]
    in_flight: dict[str, tuple[int, int]] = {}  # request id -> (conversation, turn)

    def submit(conversation: int, turn: int) -> None:
        histories[conversation] += users[conversation][turn]
        prompt = {"prompt_token_ids": list(histories[conversation])}
        in_flight[engine.add_request(prompt, params).request_id] = (conversation, turn)

    for conversation in range(workload.num_conversations):
        submit(conversation, 0)
    turns: list[Turn] = []
    total = workload.num_conversations * workload.num_turns
    with tqdm(total=total, desc=label, unit="turn", disable=not show_progress) as progress:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                conversation, turn = in_flight.pop(output.request_id)
                token_ids = list(output.outputs[0].token_ids)
                histories[conversation] += token_ids
                metrics = output.metrics
                turns.append(Turn(conversation, turn, len(output.prompt_token_ids),
                                  output.num_cached_tokens,
                                  metrics.first_token_time - metrics.arrival_time, token_ids))
                progress.update(1)
                if turn + 1 < workload.num_turns:
                    submit(conversation, turn + 1)
    return turns


def summarize(turns: list[Turn], elapsed: float, engine: LLMEngine) -> dict:
    """Throughput, TTFT percentiles (all turns; turns ≥ 2, the long histories), prompt tokens
    and what the cache and each tier served, preemptions and KV moved."""
    from kvpool.bench.throughput import tier_stats

    num_output = sum(len(turn.token_ids) for turn in turns)
    return {
        "elapsed_s": elapsed,
        "num_turns": len(turns),
        "num_output_tokens": num_output,
        "output_tokens_per_s": num_output / elapsed,
        "ttft_ms": _percentiles([turn.ttft_s for turn in turns]),
        "ttft_ms_turns_2_plus": _percentiles([turn.ttft_s for turn in turns if turn.turn >= 1]),
        "num_prompt_tokens": sum(turn.num_prompt_tokens for turn in turns),
        "num_cached_prompt_tokens": sum(turn.num_cached_tokens for turn in turns),
        "num_device_blocks": engine.memory_stats().num_blocks,
        **tier_stats(engine.stats()),
    }


def _percentiles(seconds: list[float]) -> dict[str, float | None]:
    """p50 and p99 in milliseconds (None without samples)."""
    import numpy as np

    if not seconds:
        return {"p50": None, "p99": None}
    values_ms = np.asarray(seconds) * 1e3
    return {f"p{q}": float(np.percentile(values_ms, q)) for q in (50, 99)}


def run_tier(config: EngineConfig, loaded: LoadedModel, workload: Conversations, label: str,
             show_progress: bool) -> tuple[dict, list[Turn]]:
    """One configuration on a fresh engine over `loaded`: its summary and its turns."""
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.setup import build_engine_parts

    if config.tiers.kv_disk_cache is not None and label != RESTART:  # the others start empty
        shutil.rmtree(config.tiers.kv_disk_cache, ignore_errors=True)
        Path(config.tiers.kv_disk_cache).mkdir(parents=True)
    engine = LLMEngine(config, build_engine_parts(config, loaded))
    _check_fits(engine, workload)
    start = time.perf_counter()
    turns = run_conversations(engine, workload, label, show_progress)
    result = summarize(turns, time.perf_counter() - start, engine)
    engine.close()  # the disk tier's writes finish before the next configuration runs
    del engine
    gc.collect()  # this engine's KV memory and host tier go before the next engine's come
    return result, turns


def _check_fits(engine: LLMEngine, workload: Conversations) -> None:
    need = workload.max_total_tokens
    if need > engine.max_model_len:
        raise SystemExit(f"a conversation's last turn needs {need} tokens, but max_model_len "
                         f"is {engine.max_model_len}: shorten the conversations")
    if not engine.kv_memory.can_ever_fit(need):
        capacity = engine.kv_memory.max_num_blocks * engine.kv_memory.layout.block_size
        raise SystemExit(f"a conversation's last turn needs {need} tokens, but the device KV "
                         f"pool holds {capacity}: raise --kv-cache-memory")


def compare_to_off(results: dict[str, dict]) -> None:
    """Each tiered result's TTFT percentiles over `off`'s (`ttft_vs_off`), where off ran."""
    off = results.get("off")
    if off is None:
        return
    for tier, result in results.items():
        if tier == "off":
            continue
        result["ttft_vs_off"] = {
            key: {q: _ratio(result[key][q], off[key][q]) for q in ("p50", "p99")}
            for key in ("ttft_ms", "ttft_ms_turns_2_plus")
        }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else ours / theirs


def run_tiers(configs: dict[str, EngineConfig], warmup: EngineConfig | None,
              workload: Conversations, show_progress: bool) -> dict:
    """Every configuration over one loaded model; the report's results and `outputs_identical`.
    With a `warmup` configuration, the whole workload first runs once in it, untimed: first-use
    costs that an engine's own warm-up does not reach (kernels and allocations of each new
    shape) would otherwise land on whichever configuration runs first."""
    from kvpool.engine.setup import load_engine_model

    loaded = load_engine_model(next(iter(configs.values())))  # tiers differ in no model field
    if warmup is not None:
        run_tier(warmup, loaded, workload, "warm-up", show_progress)
    results, outputs = {}, {}
    for tier, config in configs.items():
        results[tier], turns = run_tier(config, loaded, workload, tier, show_progress)
        outputs[tier] = {(turn.conversation, turn.turn): turn.token_ids for turn in turns}
    compare_to_off(results)
    first = next(iter(outputs.values()))
    mismatched = [tier for tier, tokens in outputs.items() if tokens != first]
    return {"tiers": results, "outputs_identical": not mismatched,
            "outputs_differ_in": mismatched, "dtype": str(loaded.model.dtype).removeprefix(
                "torch.")}


def run(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """The benchmark of `kvpool bench multi-turn` (flags: kvpool.cli.bench); prints a table,
    or one JSON object with `args.json`."""
    workload = Conversations(args.num_conversations, args.num_turns, args.system_prompt_len,
                             args.user_len, args.output_len, args.workload_seed)
    if min(args.num_conversations, args.num_turns, args.user_len, args.output_len) < 1 or (
            args.system_prompt_len < 0):
        raise SystemExit("--num-conversations, --num-turns, --user-len and --output-len must "
                         "be at least 1, --system-prompt-len at least 0")
    if engine_config.tiers.kv_disk_cache is not None:
        raise SystemExit("each disk configuration gets its own empty disk tier: name its "
                         "directory with --kv-disk-dir, not --kv-disk-cache")
    tiers = list(dict.fromkeys(args.tiers))
    if RESTART in tiers and ("disk" not in tiers or tiers.index("disk") > tiers.index(RESTART)):
        raise SystemExit(f"--tiers {RESTART} restarts over the files of `disk`: list disk first")
    # A late write of a disk tier's writer thread must not fail the bench at clean-up.
    with tempfile.TemporaryDirectory(prefix="kvpool-multi-turn-",
                                     ignore_cleanup_errors=True) as scratch:
        disk_root = Path(args.kv_disk_dir or scratch)  # one subdirectory per configuration

        def config(tier: str, name: str) -> EngineConfig:
            name = "disk" if name == RESTART else name
            return tier_config(engine_config, tier, str(disk_root / name.replace("+", "-")))

        # Every configuration is built before anything runs: an impossible one fails at once.
        configs = {tier: config(tier, tier) for tier in tiers}
        warmup = config(tiers[0], "warm-up") if args.warmup_pass else None
        measured = run_tiers(configs, warmup, workload, not args.json)
    report = {"workload": asdict(workload), "model": engine_config.load.model,
              "warmup_pass": args.warmup_pass,
              "kv_cache_memory": engine_config.cache.kv_cache_memory,
              "swap_space_gib": engine_config.tiers.swap_space, **measured}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def format_report(report: dict) -> str:
    """One row per configuration, then each tiered one's TTFT against `off`."""
    workload = report["workload"]
    budget = report["kv_cache_memory"]
    lines = [
        f"multi-turn: {workload['num_conversations']} conversations × {workload['num_turns']} "
        f"turns, system prompt {workload['system_prompt_len']} tokens, user turns "
        f"{workload['user_len']}, outputs {workload['output_len']} (greedy, EOS ignored), seed "
        f"{workload['seed']}; {report['dtype']}, device KV "
        f"{f'{budget / 2**20:,.1f} MiB' if budget else 'default'}, host tier "
        f"{report['swap_space_gib']:g} GiB",
    ]
    rows = [["tiers", "elapsed s", "output tok/s", "TTFT p50/p99 ms", "turns ≥ 2: p50/p99 ms",
             "prompt tokens", "cached", "served by device/host/disk",
             "preemptions recompute/swap"]]
    for tier, result in report["tiers"].items():
        by_tier = result["cached_tokens_by_tier"]
        rows.append([
            tier, f"{result['elapsed_s']:.2f}", f"{result['output_tokens_per_s']:.1f}",
            _pair(result["ttft_ms"]), _pair(result["ttft_ms_turns_2_plus"]),
            f"{result['num_prompt_tokens']:,}",
            f"{result['num_cached_prompt_tokens']:,}",
            "/".join(f"{by_tier.get(name, 0):,}" for name in ("device", "host", "disk")),
            f"{result['num_recompute_preemptions']}/{result['num_swap_preemptions']}",
        ])
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip() for row in rows]
    for tier, result in report["tiers"].items():
        if "ttft_vs_off" in result:
            ratios = result["ttft_vs_off"]
            lines.append(f"{tier} vs off: TTFT {_cuts(ratios['ttft_ms'])}; turns ≥ 2: "
                         f"{_cuts(ratios['ttft_ms_turns_2_plus'])}")
    same = "yes" if report["outputs_identical"] else (
        f"NO (differ from the first in {', '.join(report['outputs_differ_in'])})")
    lines.append(f"greedy outputs identical across configurations: {same}")
    return "\n".join(lines)


def _pair(percentiles: dict[str, float | None]) -> str:
    if percentiles["p50"] is None:
        return "–"
    return f"{percentiles['p50']:.1f}/{percentiles['p99']:.1f}"


def _cuts(ratios: dict[str, float | None]) -> str:
    def cut(ratio: float | None) -> str:
        if ratio is None:
            return "–"
        return f"cut by {1 - ratio:.0%}" if ratio <= 1 else f"up by {ratio - 1:.0%}"

    return f"p50 {cut(ratios['p50'])}, p99 {cut(ratios['p99'])}"
