"""The timeline of a recorded KV trace: a PNG and one self-contained HTML page.

`write_timeline(read_kv_trace(path), png, html)` (`kvpool inspect trace`) draws how the device
pool's blocks split into used / cached / free over time (the "step" events), with vertical
markers for preemptions, grows and shrinks, rugs for evictions (bottom) and prefix hits (top),
and alloc / free events per second in a panel below. The HTML page is inline SVG with native
`<title>` tooltips: no script, no network, so it opens offline anywhere. Everything taken from
the trace is escaped on its way into the page (request ids are client-controlled).

Large traces are drawn from at most `MAX_POINTS` samples: each bin of consecutive steps is
shown by its step with the most used blocks, so peaks survive and every drawn stack is a
state the pool really was in. Markers are binned to `MAX_POINTS` columns the same way.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.formats.kv_trace import EVENT_KINDS, KVTrace
from kvpool.inspect.palette import BLOCK_COLOURS

MAX_POINTS = 2000
MAX_RATE_BINS = 200
STEPS_PER_RATE_BIN = 5  # at least, so a short trace's rates are not one event per bin
LAYERS = tuple((state, BLOCK_COLOURS[state]) for state in ("used", "cached", "free"))
MARKERS = {"preempt": "#111111", "grow": "#2ca02c", "shrink": "#8c564b"}  # vertical lines
DASHED = ("grow", "shrink")
RUGS = {"evict": "#6a3d9a", "hit": "#17a2b8"}
RATES = {"alloc": BLOCK_COLOURS["used"], "free": "#7f7f7f"}


@dataclass(frozen=True, slots=True)
class TimelineSummary:
    """A trace's headline figures."""

    duration_s: float  # time of the last event
    num_steps: int
    peak_used_blocks: int
    peak_online_blocks: int
    event_counts: dict[str, int]  # kind -> events: the format's kinds in order, then others
    num_hit_tokens: int
    num_preemptions: int
    num_evicted_blocks: int

    def headline(self) -> str:
        return (f"{self.num_steps} steps over {self.duration_s:.2f} s · peak "
                f"{self.peak_used_blocks}/{self.peak_online_blocks} blocks used · "
                f"{self.num_preemptions} preemptions · {self.num_evicted_blocks} blocks evicted"
                f" · {self.num_hit_tokens} prefix-hit tokens")


@dataclass(frozen=True, slots=True)
class StepSeries:
    """The pool after each step, as parallel arrays."""

    step: np.ndarray
    t: np.ndarray
    used: np.ndarray
    cached: np.ndarray
    free: np.ndarray
    online: np.ndarray

    def __len__(self) -> int:
        return len(self.step)

    def take(self, indices: np.ndarray) -> StepSeries:
        return StepSeries(*(getattr(self, name)[indices] for name in self.__slots__))

    def step_at(self, times: np.ndarray) -> np.ndarray:
        """The step running at each time: the first to end at or after it (the last after)."""
        ends = np.searchsorted(np.maximum.accumulate(self.t), times, side="left")
        return self.step[np.minimum(ends, len(self) - 1)]


@dataclass(frozen=True, slots=True)
class _Marks:
    """One marker kind binned to columns: each column's centre time, event count, and first
    event (for its tooltip)."""

    times: np.ndarray
    counts: np.ndarray
    firsts: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class _Timeline:
    summary: TimelineSummary
    series: StepSeries  # downsampled
    span: tuple[float, float]  # seconds the x axis covers
    marks: dict[str, _Marks]  # MARKERS and RUGS kinds
    rate_edges: np.ndarray  # [num_bins + 1] seconds
    rates: dict[str, np.ndarray]  # RATES kinds -> events per second in each bin
    full_series: StepSeries  # every step, for seconds -> steps


def write_timeline(trace: KVTrace, png_path: str | Path | None,
                   html_path: str | Path | None) -> TimelineSummary:
    """Write the PNG and / or HTML timeline of `trace` (either path may be None)."""
    timeline = _build(trace)
    if png_path is not None:
        _write_png(timeline, Path(png_path))
    if html_path is not None:
        Path(html_path).write_text(_html_page(timeline, trace), encoding="utf-8")
    return timeline.summary


def downsample(series: StepSeries, max_points: int = MAX_POINTS) -> StepSeries:
    """At most `max_points` steps: from each bin of consecutive steps, the one using most."""
    if len(series) <= max_points:
        return series
    edges = np.linspace(0, len(series), max_points + 1).astype(np.int64)
    picks = [low + int(np.argmax(series.used[low:high])) for low, high in pairwise(edges)]
    return series.take(np.array(picks))


def _build(trace: KVTrace) -> _Timeline:
    rows, events_of, counts = [], {kind: [] for kind in (*MARKERS, *RUGS, *RATES)}, Counter()
    for event in trace.events:
        kind = str(event["e"])  # a hostile kind may be any JSON value
        counts[kind] += 1
        if kind == "step":
            rows.append((event["s"], event["t"], event.get("u", 0), event.get("c", 0),
                         event.get("f", 0), event.get("o", 0)))
        elif kind in events_of:
            events_of[kind].append(event)
    table = np.array(rows, dtype=np.float64).reshape(-1, 6)
    full = StepSeries(*table.T)
    times = [float(event["t"]) for event in trace.events]
    start, end = min(times, default=0.0), max(times, default=0.0)
    span = (start, end if end > start else start + 1.0)  # events before the first step count
    summary = TimelineSummary(
        duration_s=end, num_steps=len(full),
        peak_used_blocks=int(full.used.max(initial=0)),
        peak_online_blocks=int(full.online.max(initial=trace.header.num_blocks)),
        event_counts=_ordered_counts(counts),
        num_hit_tokens=sum(int(event.get("c", 0)) for event in events_of["hit"]),
        num_preemptions=counts["preempt"],
        num_evicted_blocks=sum(len(event.get("b", ())) for event in events_of["evict"]))
    num_rate_bins = min(MAX_RATE_BINS, max(1, len(full) // STEPS_PER_RATE_BIN))
    rate_edges = np.linspace(*span, num_rate_bins + 1)
    rates = {kind: np.histogram(_times(events_of[kind]), rate_edges)[0]
             / (rate_edges[1] - rate_edges[0]) for kind in RATES}
    marks = {kind: _bin_marks(events_of[kind], span) for kind in (*MARKERS, *RUGS)}
    return _Timeline(summary, downsample(full), span, marks, rate_edges, rates, full)


def _ordered_counts(counts: Counter[str]) -> dict[str, int]:
    kinds = [kind for kind in EVENT_KINDS if kind in counts]
    return {kind: counts[kind] for kind in kinds + sorted(counts.keys() - set(kinds))}


def _times(events: list[dict[str, Any]]) -> np.ndarray:
    return np.array([float(event["t"]) for event in events], dtype=np.float64)


def _bin_marks(events: list[dict[str, Any]], span: tuple[float, float]) -> _Marks:
    width = (span[1] - span[0]) / MAX_POINTS
    columns = np.clip(((_times(events) - span[0]) / width).astype(np.int64), 0, MAX_POINTS - 1)
    unique, firsts, counts = np.unique(columns, return_index=True, return_counts=True)
    return _Marks(span[0] + (unique + 0.5) * width, counts, [events[i] for i in firsts])


def _describe(event: dict[str, Any]) -> str:
    """A tooltip line for one marker event (plain text; the caller escapes it)."""
    kind, when = event["e"], f"{float(event['t']):.3f} s, step {event['s']}: "
    if kind in ("grow", "shrink"):
        sign = "+" if kind == "grow" else "-"
        return f"{when}{kind} {sign}{event.get('d')} blocks, {event.get('n')} online"
    if kind == "evict":
        return f"{when}evict {len(event.get('b', ()))} blocks"
    who = f"{event.get('r')} #{event.get('q')}"
    if kind == "hit":
        return f"{when}hit {who}: {event.get('c')} tokens"
    return f"{when}preempt {who} ({event.get('m')}, {len(event.get('b', ()))} blocks)"


def _write_png(timeline: _Timeline, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 6), layout="constrained")
    figure.suptitle(timeline.summary.headline(), fontsize="medium")
    if not len(timeline.series):
        axes = figure.subplots()
        axes.set_axis_off()
        axes.text(0.5, 0.5, _nothing_recorded(timeline.summary), ha="center", va="center",
                  fontsize="large", transform=axes.transAxes)
        figure.savefig(path, dpi=110)
        return
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    _plot_pool(top, timeline)
    for kind, color in RATES.items():
        bottom.stairs(timeline.rates[kind], timeline.rate_edges, color=color, label=kind)
    bottom.set_ylabel("events / s")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right", fontsize="small", frameon=False)
    figure.savefig(path, dpi=110)


def _plot_pool(axes: Any, timeline: _Timeline) -> None:
    series = timeline.series
    axes.stackplot(series.t, series.used, series.cached, series.free, step="post",
                   colors=[color for _, color in LAYERS], labels=[name for name, _ in LAYERS])
    for kind, color in MARKERS.items():
        marks = timeline.marks[kind]
        if len(marks.times):
            axes.vlines(marks.times, 0, 1, transform=axes.get_xaxis_transform(), colors=color,
                        linewidth=1.4 if kind in DASHED else 0.8, alpha=0.8, label=kind,
                        linestyles="--" if kind in DASHED else "-")
    for (kind, color), height in zip(RUGS.items(), (0.02, 0.98), strict=True):
        marks = timeline.marks[kind]
        if len(marks.times):
            axes.plot(marks.times, np.full(len(marks.times), height), "|", color=color,
                      markersize=8, transform=axes.get_xaxis_transform(), label=kind)
    axes.set_xlim(*timeline.span)
    axes.set_ylabel("device blocks")
    # Step labels at times, not a step scale: steps run at very different rates in a trace.
    ticks = np.linspace(*timeline.span, 7)
    steps = axes.secondary_xaxis("top")
    steps.set_xticks(ticks, labels=[f"{s:.0f}" for s in timeline.full_series.step_at(ticks)])
    steps.set_xlabel("step running")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def _nothing_recorded(summary: TimelineSummary) -> str:
    num_events = sum(summary.event_counts.values())
    return (f"Nothing recorded: the trace has no steps ({num_events} events).\n"
            "Was the engine stopped before its first step?")


WIDTH, LEFT, TOP, POOL_HEIGHT, GAP, RATE_HEIGHT = 1000, 64, 28, 300, 56, 90
_CSS = ("body{font:14px system-ui,sans-serif;margin:24px;color:#222}"
        "svg text{font-size:11px;fill:#444}.col{fill:transparent}"
        ".col:hover{fill:rgba(0,0,0,.12)}.sw{display:inline-block;width:12px;height:12px;"
        "margin:0 4px 0 12px;vertical-align:middle}table{border-collapse:collapse}"
        "td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:right}")


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _html_page(timeline: _Timeline, trace: KVTrace) -> str:
    summary, header = timeline.summary, trace.header
    body = (_svg(timeline) if len(timeline.series)
            else f"<p><strong>{_esc(_nothing_recorded(summary))}</strong></p>")
    legend = "".join(f'<span class="sw" style="background:{color}"></span>{_esc(name)}'
                     for name, color in (*LAYERS, *MARKERS.items(), *RUGS.items(),
                                         *((f"{kind} / s", c) for kind, c in RATES.items())))
    rows = "".join(f"<tr><td style='text-align:left'>{_esc(kind)}</td><td>{count}</td></tr>"
                   for kind, count in summary.event_counts.items())
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>KV timeline</title>"
            f"<style>{_CSS}</style></head><body><h2>KV timeline</h2>"
            f"<p>{_esc(summary.headline())}</p><p>pool: {header.num_blocks} blocks of "
            f"{header.block_size} tokens, {header.bytes_per_block} B each "
            f"({_esc(header.kv_cache_dtype)})</p><div>{legend}</div>{body}"
            "<h3>Events</h3><table><tr><th style='text-align:left'>kind</th><th>count</th>"
            f"</tr>{rows}</table></body></html>\n")


def _svg(timeline: _Timeline) -> str:
    series, (t0, t1) = timeline.series, timeline.span
    height = TOP + POOL_HEIGHT + GAP + RATE_HEIGHT + 32
    y_max = float(max((series.used + series.cached + series.free).max(), 1))

    def x(times: np.ndarray) -> np.ndarray:
        return LEFT + (np.asarray(times) - t0) / (t1 - t0) * WIDTH

    def y(values: np.ndarray) -> np.ndarray:
        return TOP + POOL_HEIGHT - np.asarray(values) / y_max * POOL_HEIGHT

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 48}" '
             f'height="{height}">']
    parts += _areas(x(series.t), series, y, x(np.array([t1]))[0])
    parts += _columns(x(series.t), series, x(np.array([t1]))[0])
    parts += _marker_lines(timeline, x)
    parts += _rate_lines(timeline, x)
    parts += _axes(timeline, x, y_max)
    return "".join(parts) + "</svg>"


def _points(xs: np.ndarray, ys: np.ndarray) -> str:
    return " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(xs, ys, strict=True))


def _areas(xs: np.ndarray, series: StepSeries, y: Any, x_end: float) -> list[str]:
    """The stacked layers as step-shaped polygons."""
    step_xs = np.append(np.repeat(xs, 2)[1:], x_end)
    below = np.zeros(len(series))
    polygons = []
    for name, color in LAYERS:
        above = below + getattr(series, name)
        outline = np.concatenate([y(np.repeat(above, 2)), y(np.repeat(below, 2))[::-1]])
        polygons.append(f'<polygon fill="{color}" points="'
                        f'{_points(np.concatenate([step_xs, step_xs[::-1]]), outline)}"/>')
        below = above
    return polygons


def _columns(xs: np.ndarray, series: StepSeries, x_end: float) -> list[str]:
    """One hover column per drawn step, its tooltip the pool after that step."""
    rights = np.append(xs[1:], x_end)
    return [f'<rect class="col" x="{left:.1f}" y="{TOP}" width="{max(right - left, 0.5):.1f}" '
            f'height="{POOL_HEIGHT}"><title>step {int(s)} · {t:.3f} s · used {int(u)} · '
            f'cached {int(c)} · free {int(f)} · online {int(o)}</title></rect>'
            for left, right, s, t, u, c, f, o in zip(
                xs, rights, series.step, series.t, series.used, series.cached, series.free,
                series.online, strict=True)]


def _marker_lines(timeline: _Timeline, x: Any) -> list[str]:
    parts = []
    spans = {kind: (TOP, TOP + POOL_HEIGHT) for kind in MARKERS}
    spans |= {"evict": (TOP + POOL_HEIGHT - 10, TOP + POOL_HEIGHT), "hit": (TOP, TOP + 10)}
    for kind, color in (*MARKERS.items(), *RUGS.items()):
        marks, (low, high) = timeline.marks[kind], spans[kind]
        dash = ' stroke-dasharray="5 3"' if kind in DASHED else ""
        for position, count, first in zip(x(marks.times), marks.counts, marks.firsts,
                                          strict=True):
            more = f" (and {count - 1} more)" if count > 1 else ""
            parts.append(f'<line x1="{position:.1f}" x2="{position:.1f}" y1="{low}" '
                         f'y2="{high}" stroke="{color}" stroke-width="2" opacity="0.8"{dash}>'
                         f'<title>{_esc(_describe(first) + more)}</title></line>')
    return parts


def _rate_lines(timeline: _Timeline, x: Any) -> list[str]:
    base = TOP + POOL_HEIGHT + GAP + RATE_HEIGHT
    rate_max = max(max(float(rates.max(initial=0)) for rates in timeline.rates.values()), 1.0)
    xs = np.repeat(x(timeline.rate_edges), 2)[1:-1]
    parts = []
    for kind, color in RATES.items():
        ys = base - np.repeat(timeline.rates[kind], 2) / rate_max * RATE_HEIGHT
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" '
                     f'points="{_points(xs, ys)}"><title>{kind} events / s</title></polyline>')
    parts.append(f'<text x="4" y="{base - RATE_HEIGHT - 14}">alloc / free events per second'
                 f'</text><text x="{LEFT - 6}" y="{base - RATE_HEIGHT + 4}" text-anchor="end">'
                 f'{rate_max:.0f}</text><text x="{LEFT - 6}" y="{base}" text-anchor="end">0</text>')
    return parts


def _axes(timeline: _Timeline, x: Any, y_max: float) -> list[str]:
    """Tick labels: seconds and steps below, blocks at the left."""
    base = TOP + POOL_HEIGHT + GAP + RATE_HEIGHT
    ticks = np.linspace(*timeline.span, 6)
    parts = [f'<text x="{position:.1f}" y="{base + 14}" text-anchor="middle">{t:.2f} s</text>'
             f'<text x="{position:.1f}" y="{base + 28}" text-anchor="middle">step {s:.0f}'
             f'</text>' for position, t, s in zip(x(ticks), ticks,
                                                  timeline.full_series.step_at(ticks), strict=True)]
    for value in (0, y_max / 2, y_max):
        level = TOP + POOL_HEIGHT - value / y_max * POOL_HEIGHT
        parts.append(f'<text x="{LEFT - 6}" y="{level + 4:.1f}" text-anchor="end">'
                     f'{value:.0f}</text>')
    parts.append(f'<text x="4" y="{TOP - 12}">device blocks</text>')
    return parts
