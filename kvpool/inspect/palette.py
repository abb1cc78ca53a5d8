"""The one palette for KV block states, in every picture of the pool.

The PNG pool map (`kvpool.inspect.pool_map`) reads it here, and the server injects it into the
dashboard page (`kvpool.server.kv_routes`: `{"states": BLOCK_COLOURS, "shared":
SHARED_MARKER_COLOUR, "leased": LEASED_COLOUR}`), so the two draw states alike from this one
definition. Keys are the block states of `kvpool.formats.kv_snapshot`, in `BLOCK_STATES` order
(legends follow it). A shared block (ref_count > 1) is a used block with a mark on top, not a
state of its own; a leased block (a kv_producer's, kept for a decode worker) is a used block
drawn in its own colour, whoever else holds it.
"""

from __future__ import annotations

BLOCK_COLOURS: dict[str, str] = {
    "free": "#e6e6e6",  # light grey: empty, on the free list
    "used": "#e4572e",  # red-orange: held by a sequence's block table
    "cached": "#4c9be8",  # blue: unreferenced but remembers a prefix; reusable, evicted on demand
    "offline": "#3b3b3b",  # dark grey: no memory behind the id (the null block, given back)
    "other": "#b07cc6",  # purple: used by another tenant's sequences (a tenant's view)
}
SHARED_MARKER_COLOUR = "#ffd23f"  # yellow: the mark on a block several sequences hold
LEASED_COLOUR = "#2a9d8f"  # teal: held by a live lease for a decode worker (kv_transfer_config)
BACKGROUND_COLOUR = "#ffffff"  # grid cells past the last block id
