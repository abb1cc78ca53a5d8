"""The readable report of `kvpool bench speculative`: one table per dtype, one row per workload,
concurrency and setting (then each baseline), and a bar chart of the same (`--plot`)."""

from __future__ import annotations

import math
from pathlib import Path

from kvpool.bench.throughput_report import _agreement, _columns

_HEADER = ["workload", "concurrency", "setting", "tok/s at N", "rounds", "over off",
           "whole run tok/s", "over off", "acceptance", "accepted/draft", "drafts",
           "same tokens as off"]


def format_report(report: dict) -> str:
    settings = ", ".join(report["settings"])
    lines = [f"settings {settings}; greedy, up to {report['output_len']} tokens per request "
             f"(grounded stops at EOS, open ignores it); concurrency "
             f"{', '.join(map(str, report['concurrency']))}; median of {report['rounds']} "
             f"alternating rounds; workload seed {report['workload_seed']}"]
    for result in report["dtypes"]:
        lines += ["", *_dtype_section(result)]
    return "\n".join(lines)


def _dtype_section(result: dict) -> list[str]:
    seconds = result["start_up_s"]
    starts = ", ".join(f"{label} {value:.1f} s" for label, value in seconds.items()
                       if label != "load")
    lines = [f"{result['dtype']}: model loaded in {seconds['load']:.1f} s; engines started: "
             f"{starts}"]
    rows = [_HEADER]
    for row in result["results"]:
        for label, setting in row["settings"].items():
            rows.append(_setting_row(row, label, setting))
        for name, label in result["baselines"].items():
            if name in row.get("baselines", {}):
                rows.append(_baseline_row(row, label, row["baselines"][name]))
    lines += _columns(rows)
    lines += [f"{label} did not finish: {result[f'{name}_error']}"
              for name, label in result["baselines"].items() if f"{name}_error" in result]
    lines += _workload_lines(result)
    return lines


def _setting_row(row: dict, label: str, setting: dict) -> list[str]:
    rates = setting["steady_output_tokens_per_s_rounds"]
    rate = setting["acceptance_rate"]
    per_draft = setting["mean_accepted_tokens_per_draft"]
    return [row["workload"], str(row["concurrency"]), label,
            f"{setting['steady_output_tokens_per_s']:.1f}", f"{min(rates):.1f}–{max(rates):.1f}",
            f"{setting['steady_over_off']:.2f}×", f"{setting['output_tokens_per_s']:.1f}",
            f"{setting['over_off']:.2f}×", "–" if rate is None else f"{rate:.0%}",
            "–" if per_draft is None else f"{per_draft:.2f}",
            f"{setting['spec_decode']['num_drafts']:,}", _agreement(setting["tokens_vs_off"])]


def _baseline_row(row: dict, label: str, measured: dict) -> list[str]:
    return [row["workload"], str(row["concurrency"]), label,
            f"{measured['steady_output_tokens_per_s']:.1f}", "",
            f"{measured['steady_over_off']:.2f}×", f"{measured['output_tokens_per_s']:.1f}",
            f"{measured['over_off']:.2f}×", "–", "–", "–", _agreement(measured["tokens_vs_off"])]


def _workload_lines(result: dict) -> list[str]:
    """Per workload: its prompts' fingerprint, and how far off's outputs copy."""
    lines = []
    for name, workload in result["workloads"].items():
        rows = [row for row in result["results"] if row["workload"] == name]
        lengths = workload["prompt_lengths"]
        lines.append(f"{name}: prompts {min(lengths)}–{max(lengths)} tokens, fingerprint "
                     f"{workload['fingerprint']}; 3-grams of off's outputs found in their "
                     f"prompt / in prompt or earlier output, by concurrency: "
                     + ", ".join(f"{row['concurrency']}: {_share(row['output_3grams_in_prompt'])}"
                                 f" / {_share(row['output_3grams_in_context'])}" for row in rows))
    return lines


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def plot_report(report: dict, path: str | Path) -> None:
    """Output tokens/s at N in flight by concurrency, one bar per setting (and baseline) in
    each concurrency's group, ratios over off above the bars; a panel per dtype and workload."""
    from matplotlib.figure import Figure

    panels = [(result, workload) for result in report["dtypes"]
              for workload in report["workloads"]]
    figure = Figure(figsize=(4.5 * len(report["workloads"]), 3.6 * len(report["dtypes"])),
                    layout="constrained")
    axes_grid = figure.subplots(len(report["dtypes"]), len(report["workloads"]), squeeze=False)
    for axes, (result, workload) in zip(axes_grid.flat, panels, strict=True):
        _plot_panel(axes, result, workload)
    figure.savefig(path, dpi=110)


def _plot_panel(axes, result: dict, workload: str) -> None:
    rows = [row for row in result["results"] if row["workload"] == workload]
    bars = {}  # label -> [(tok/s, over off) per concurrency]
    for row in rows:
        measured = {**row["settings"], **{result["baselines"][name]: value for name, value
                                          in row.get("baselines", {}).items()}}
        for label, value in measured.items():
            bars.setdefault(label, []).append((value["steady_output_tokens_per_s"],
                                               value["steady_over_off"]))
    width = 0.8 / max(len(bars), 1)
    for index, (label, values) in enumerate(bars.items()):
        positions = [group + (index - (len(bars) - 1) / 2) * width
                     for group in range(len(values))]
        drawn = axes.bar(positions, [rate for rate, _ in values], width, label=label)
        axes.bar_label(drawn, [f"{ratio:.2f}" for _, ratio in values], fontsize=6)
    axes.set_xticks(range(len(rows)), [str(row["concurrency"]) for row in rows])
    axes.set_yscale("log")  # 1 and 32 requests differ tenfold; a decade floor keeps bars honest
    lowest = min(rate for values in bars.values() for rate, _ in values)
    axes.set_ylim(bottom=10 ** math.floor(math.log10(lowest)))
    axes.set_xlabel("requests in flight")
    axes.set_ylabel("output tokens/s at N in flight")
    axes.set_title(f"{result['dtype']}, {workload} (log scale; labels: over off)", fontsize=9)
    axes.legend(fontsize="x-small", frameon=False)
