"""The simulator's outputs: a text table, a JSON list, and two PNG plots (matplotlib, Agg).

Plots are drawn on `matplotlib.figure.Figure` objects directly, so no GUI backend or global
pyplot state is involved and matplotlib loads only when plots are asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvpool.sim.simulate import SimResult

_COLUMNS = (
    # header, width, cell
    ("strategy", 24, lambda r: r.strategy),
    ("tokens", 7, lambda r: f"{r.token_state_fraction:.1%}"),
    ("reserved", 8, lambda r: f"{r.reservation_fraction:.1%}"),
    ("internal", 8, lambda r: f"{r.internal_fragmentation:.1%}"),
    ("free", 6, lambda r: f"{r.free_fraction:.1%}"),
    ("ext.frag", 8, lambda r: f"{r.external_fragmentation:.2f}"),
    ("peak", 5, lambda r: str(r.peak_concurrency)),
    ("mean", 6, lambda r: f"{r.mean_concurrency:.1f}"),
    ("steps", 7, lambda r: str(r.steps)),
    ("preempt", 7, lambda r: str(r.num_preemptions)),
    ("moved GiB", 9, lambda r: f"{r.num_bytes_moved / (1 << 30):.1f}"),
)
_COMPOSITION = (
    ("token states", "token_state_fraction", "#2a9d8f"),
    ("reservation", "reservation_fraction", "#e9c46a"),
    ("internal fragmentation", "internal_fragmentation", "#e76f51"),
    ("free", "free_fraction", "#d9d9d9"),
)


def format_table(results: Sequence[SimResult]) -> str:
    """One row per strategy; memory columns are fractions of the budget (memory-bound steps),
    peak/mean are concurrent sequences, steps is the makespan, moved is the KV that
    compactions copied (contiguous-exact-compact; 0 for strategies that never move data)."""
    header = "  ".join(f"{name:<{width}}" if index == 0 else f"{name:>{width}}"
                       for index, (name, width, _) in enumerate(_COLUMNS))
    lines = [header, "-" * len(header)]
    for result in results:
        lines.append("  ".join(f"{cell(result):<{width}}" if index == 0
                               else f"{cell(result):>{width}}"
                               for index, (_, width, cell) in enumerate(_COLUMNS)))
    return "\n".join(lines)


def to_json(results: Sequence[SimResult]) -> list[dict[str, object]]:
    return [result.to_json() for result in results]


def plot_composition(results: Sequence[SimResult], path: Path) -> None:
    """Stacked horizontal bars: where each strategy's budget goes."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 0.45 * len(results) + 1.6), layout="constrained")
    axes = figure.subplots()
    names = [result.strategy for result in results][::-1]
    left = [0.0] * len(results)
    for label, attribute, color in _COMPOSITION:
        widths = [100 * getattr(result, attribute) for result in results][::-1]
        axes.barh(names, widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axes.set_xlim(0, 100)
    axes.set_xlabel("% of the KV budget (mean over memory-bound steps)")
    axes.set_title("KV memory composition per allocation strategy")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(results)), ncol=4,
                frameon=False)
    figure.savefig(path, dpi=110)


def plot_concurrency(results: Sequence[SimResult], path: Path) -> None:
    """Running sequences per step, one line per strategy."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 4.8), layout="constrained")
    axes = figure.subplots()
    colors = colormaps["tab20"].colors
    for index, result in enumerate(results):
        axes.plot(result.concurrency, color=colors[index % len(colors)], linewidth=0.9,
                  label=result.strategy)
    axes.set_xlabel("step")
    axes.set_ylabel("running sequences")
    axes.set_title("Concurrency over time")
    axes.legend(fontsize="small", ncol=2, frameon=False)
    figure.savefig(path, dpi=110)


def write_plots(results: Sequence[SimResult], plot_dir: str | Path) -> list[Path]:
    """Write `memory_composition.png` and `concurrency.png` into `plot_dir`."""
    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_dir / "memory_composition.png", plot_dir / "concurrency.png"]
    plot_composition(results, paths[0])
    plot_concurrency(results, paths[1])
    return paths
