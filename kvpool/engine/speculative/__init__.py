"""Speculative decoding: draft several tokens, verify them in one forward pass, keep what the
model itself would have chosen.

    ngram.py       prompt lookup: an incremental index of each sequence's n-grams
    adaptive.py    when drafting pays: per-sequence acceptance and the measured step cost
    speculator.py  the scheduler's partner: proposes sized drafts, learns from verification,
                   keeps seeded streams exact (`Speculator`; `NoSpeculation` when off)
    stats.py       vLLM's spec-decode counters

The KV side is the block table's: drafts get tentative slots, and the verification commits
the accepted ones and drops the rest (`kvpool.memory.block_table`).
"""

from kvpool.engine.speculative.speculator import (
    NoSpeculation,
    Speculator,
    accepted_length,
    make_speculator,
)
from kvpool.engine.speculative.stats import SpecDecodeStats

__all__ = ["NoSpeculation", "SpecDecodeStats", "Speculator", "accepted_length",
           "make_speculator"]
