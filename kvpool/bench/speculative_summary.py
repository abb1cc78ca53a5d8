"""The figures of `kvpool bench speculative`, from its runs: per (workload, concurrency) and
setting, the median tokens/s at N in flight and over the whole run, each with the median of the
per-round ratios over `off` (a ratio within one round sees one machine speed); acceptance from
the spec-decode counts of all rounds; token-for-token agreement with off's greedy outputs (the
worst round); how far off's outputs copy their prompts; and a baseline's figures beside them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.bench.throughput import compare_tokens

if TYPE_CHECKING:
    from kvpool.bench.closed_loop import Run

OFF = "off"  # the setting every ratio and agreement is taken against


def summarize(run: Run, rounds: dict[str, list[dict]]) -> dict:
    """One (workload, concurrency) row group: per setting, the median tokens/s at N in flight
    and over the whole run, each with the median per-round ratio over off; acceptance over all
    rounds; and agreement with off's tokens (the worst round)."""
    off = rounds[OFF]
    settings = {}
    for label, runs in rounds.items():
        spec = _summed_spec_counts([result["spec_decode"] for result in runs])
        agreements = [compare_tokens(result["token_ids"], reference["token_ids"])
                      for result, reference in zip(runs, off, strict=True)]
        settings[label] = {
            **_rates(runs, off, "steady_output_tokens_per_s"),
            **_rates(runs, off, "output_tokens_per_s"),
            "num_output_tokens_rounds": [result["num_output_tokens"] for result in runs],
            "mean_in_flight": statistics.median(result["mean_in_flight"] for result in runs),
            "num_steps_rounds": [result["num_steps"] for result in runs],
            "num_preemptions": max(result["num_preemptions"] for result in runs),
            "spec_decode": spec,
            **_acceptance(spec),
            "tokens_vs_off": min(agreements, key=lambda tokens: tokens["identical_requests"]),
        }
    return {"workload": run.workload, "concurrency": run.concurrency,
            "num_requests": len(run.prompts), **ngram_shares(run.prompts, off[0]["token_ids"]),
            "settings": settings, "token_ids_off": off[0]["token_ids"]}


def _rates(runs: list[dict], off: list[dict], key: str) -> dict:
    """`key`'s median over the rounds, each round's, and the median per-round ratio over off
    (`<key>_rounds`, `<key without tokens_per_s>over_off`)."""
    rates = [result[key] for result in runs]
    ratios = [rate / reference[key] for rate, reference in zip(rates, off, strict=True)]
    return {key: statistics.median(rates), f"{key}_rounds": rates,
            key.replace("output_tokens_per_s", "over_off"): statistics.median(ratios)}


def _summed_spec_counts(counts: list[dict]) -> dict:
    width = max(len(count["num_accepted_tokens_per_pos"]) for count in counts)
    per_pos = [sum(count["num_accepted_tokens_per_pos"][position]
                   for count in counts if position < len(count["num_accepted_tokens_per_pos"]))
               for position in range(width)]
    return {**{name: sum(count[name] for count in counts)
               for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "num_accepted_tokens_per_pos": per_pos}


def _acceptance(spec: dict) -> dict:
    """Accepted of drafted tokens, accepted per draft, and per draft position (None without
    drafts: off, or speculation switched off throughout)."""
    drafts = spec["num_drafts"]
    if not drafts:
        return {"acceptance_rate": None, "mean_accepted_tokens_per_draft": None,
                "acceptance_rate_per_position": []}
    return {"acceptance_rate": spec["num_accepted_tokens"] / spec["num_draft_tokens"],
            "mean_accepted_tokens_per_draft": spec["num_accepted_tokens"] / drafts,
            "acceptance_rate_per_position": [count / drafts
                                             for count in spec["num_accepted_tokens_per_pos"]]}


def ngram_shares(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                 n: int = 3) -> dict[str, float | None]:
    """How far a workload's answers copy: the share of the outputs' n-grams found in their own
    prompt, and in their prompt or earlier in their output (where prompt lookup finds drafts);
    None for outputs shorter than n."""
    in_prompt = in_context = total = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        text = [*prompt, *output]
        grams = [tuple(text[i:i + n]) for i in range(len(text) - n + 1)]
        prompt_grams = set(grams[:max(len(prompt) - n + 1, 0)])
        seen = set(grams[:len(prompt)])  # every n-gram that starts before the output does
        for gram in grams[len(prompt):]:  # the n-grams wholly inside the output
            in_prompt += gram in prompt_grams
            in_context += gram in seen
            seen.add(gram)
            total += 1
    return {f"output_{n}grams_in_prompt": in_prompt / total if total else None,
            f"output_{n}grams_in_context": in_context / total if total else None}


def compare_baseline(result: dict, name: str) -> None:
    """Add to each grounded row the baseline's median tokens/s (at N in flight and over the
    whole run), each over kvpool's off, and how far its tokens agree with off's."""
    for row in result["results"]:
        theirs = result[name]["runs"].get(f"{row['workload']}/{row['concurrency']}")
        if theirs is None:
            continue
        off = row["settings"][OFF]
        measured = {"tokens_vs_off": compare_tokens(theirs["token_ids"], row["token_ids_off"])}
        for key in ("steady_output_tokens_per_s", "output_tokens_per_s"):
            measured[key] = statistics.median(theirs[f"{key}_rounds"])
            measured[key.replace("output_tokens_per_s", "over_off")] = measured[key] / off[key]
        row.setdefault("baselines", {})[name] = measured
