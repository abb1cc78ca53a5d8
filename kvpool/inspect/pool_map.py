"""The pool map: every block of a `KVSnapshot` as one cell of a grid, coloured by its state.

Blocks are laid out by id, row after row (64 per row for small pools, about twice as many
columns as rows for large ones). The picture is one RGB array drawn with a single `imshow`
(no patch per block), so a 100,000-block pool draws in about a second. Each cell is a few
pixels square; a shared block (ref_count > 1) gets a mark in its centre, and a block a live
lease holds (kept for a decode worker) takes the lease colour whatever its state. Colours come
from `kvpool.inspect.palette`, the definition the dashboard uses too. With a host tier, its pool
is a second panel under the device's.

Matplotlib is driven through its object API on the Agg canvas (no pyplot, no global backend),
so drawing from a server thread or a test changes nothing else.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvpool.formats.kv_snapshot import BLOCK_STATES, USED, KVSnapshot, PoolView
from kvpool.inspect.palette import (
    BACKGROUND_COLOUR,
    BLOCK_COLOURS,
    LEASED_COLOUR,
    SHARED_MARKER_COLOUR,
)

SMALL_POOL_COLUMNS = 64
_DPI = 100


def draw_pool_map(snapshot: KVSnapshot, path: str | Path) -> Path:
    """Write the map of every pool in `snapshot` to `path` (PNG); returns the path."""
    names = list(snapshot.pools)
    images = [_pool_image(snapshot.pools[name]) for name in names]
    width_px = max(image.shape[1] for image in images)
    heights = [image.shape[0] for image in images]
    figure = Figure(figsize=(max(8.0, width_px / _DPI + 0.5),
                             sum(heights) / _DPI + 0.9 * len(images) + 0.5), dpi=_DPI,
                    layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(images), 1, squeeze=False,
                           gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, name, image in zip(axes, names, images, strict=True):
        _draw_panel(ax, snapshot.pools[name], name, image)
    figure.suptitle(_title(snapshot))
    path = Path(path)
    figure.savefig(path, format="png")
    return path


def grid_shape(num_cells: int) -> tuple[int, int]:
    """(rows, columns) of the grid for `num_cells` blocks."""
    if num_cells <= SMALL_POOL_COLUMNS * SMALL_POOL_COLUMNS // 2:
        columns = SMALL_POOL_COLUMNS
    else:
        columns = math.ceil(math.sqrt(2 * num_cells))
    return math.ceil(num_cells / columns), columns


def _cell_pixels(num_cells: int) -> int:
    """Pixels per cell side: enough for a visible centre mark, few enough for big pools."""
    return 12 if num_cells <= 2048 else 6 if num_cells <= 20_000 else 3


def _pool_image(view: PoolView) -> np.ndarray:
    """The panel's RGB array: [rows * cell, columns * cell, 3], floats in [0, 1]."""
    counts = np.fromiter((run.count for run in view.runs), dtype=np.int64, count=len(view.runs))
    codes = np.repeat(np.fromiter((BLOCK_STATES.index(run.state) for run in view.runs),
                                  dtype=np.int64, count=len(view.runs)), counts)
    shared = np.repeat(np.fromiter((run.state == USED and run.ref_count > 1 for run in view.runs),
                                   dtype=bool, count=len(view.runs)), counts)
    rows, columns = grid_shape(len(codes))
    padding = rows * columns - len(codes)
    leased, background = len(BLOCK_STATES), len(BLOCK_STATES) + 1
    if view.leases:
        codes[np.fromiter(view.leases, dtype=np.int64, count=len(view.leases))] = leased
    codes = np.append(codes, np.full(padding, background)).reshape(rows, columns)
    shared = np.append(shared, np.zeros(padding, dtype=bool)).reshape(rows, columns)
    colours = np.array([to_rgb(BLOCK_COLOURS[state]) for state in BLOCK_STATES]
                       + [to_rgb(LEASED_COLOUR), to_rgb(BACKGROUND_COLOUR)])
    cell = _cell_pixels(rows * columns)
    image = np.repeat(np.repeat(colours[codes], cell, axis=0), cell, axis=1)
    gap = max(1, cell // 6)  # a pale seam between cells, where they are big enough to see
    if cell >= 6:
        seam = np.zeros((cell, cell), dtype=bool)
        seam[-gap:, :] = seam[:, -gap:] = True
        image[np.tile(seam, (rows, columns))] = to_rgb(BACKGROUND_COLOUR)
    mark = np.zeros((cell, cell), dtype=bool)
    low, high = cell // 3, cell - cell // 3
    mark[low:high, low:high] = True
    marked = np.repeat(np.repeat(shared, cell, axis=0), cell, axis=1) & np.tile(mark,
                                                                                (rows, columns))
    image[marked] = to_rgb(SHARED_MARKER_COLOUR)
    return image


def _draw_panel(ax, view: PoolView, name: str, image: np.ndarray) -> None:
    ax.imshow(image, interpolation="nearest", aspect="equal")
    ax.set_axis_off()
    _, columns = grid_shape(view.capacity_blocks)
    ax.set_title(f"{name} pool: {view.num_blocks} blocks online of {view.capacity_blocks} ids, "
                 f"{columns} per row", fontsize=10)
    num_shared = sum(run.count for run in view.runs if run.state == USED and run.ref_count > 1)
    handles = [Patch(facecolor=BLOCK_COLOURS[state], edgecolor="#999999",
                     label=f"{state} {view.count(state)}") for state in BLOCK_STATES]
    handles.append(Patch(facecolor=SHARED_MARKER_COLOUR, edgecolor="#999999",
                         label=f"shared mark (ref_count > 1) {num_shared}"))
    if view.leases:
        handles.append(Patch(facecolor=LEASED_COLOUR, edgecolor="#999999",
                             label=f"leased for decode {len(view.leases)}"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0),
              ncol=len(handles), fontsize=8, frameon=False)


def _title(snapshot: KVSnapshot) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snapshot.time))
    stats = snapshot.stats
    return (f"KV pool at {when}, step {snapshot.step}: {stats.usage:.1%} used "
            f"({stats.num_used_blocks} of {stats.num_blocks} blocks), "
            f"{stats.num_cached_blocks} cached")
