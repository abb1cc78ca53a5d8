"""The README's memory-core example runs as written and leaves the pool as its comments say."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_memory_core_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    (example,) = [block for block in blocks if "from kvpool.memory import" in block]
    namespace: dict[str, object] = {}
    exec(example, namespace)
    pool = namespace["pool"]
    stats = pool.stats()
    assert stats.num_used_blocks == 0 and stats.num_cached_blocks == 1
    assert stats.prefix_cache_hits_tokens == 4
    pool.check_invariants()
