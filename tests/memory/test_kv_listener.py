"""The KV listener fan-out: registered listeners hear each event once, observers before those
that react, in registration order; an unregistered one hears nothing. A pool emits through it
with its medium, and the memory package imports nothing above it (type-only imports too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvpool.memory.block_pool import HOST, BlockPool
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_listener import KVListener, KVListeners
from kvpool.memory.prefix_cache import hash_full_blocks
from kvpool.memory.sequence_blocks import SequenceBlocks

LAYOUT = KVLayout(block_size=2)
ABOVE_MEMORY = ("kvpool.engine", "kvpool.server", "kvpool.router", "kvpool.inspect",
                "kvpool.bench", "kvpool.cli", "kvpool.sim")


class Recording(KVListener):
    """Appends (its name, the event, its main argument) to a shared list."""

    def __init__(self, name: str, heard: list[tuple]) -> None:
        self.name = name
        self.heard = heard

    def block_stored(self, medium, block_id, block_hash, parent_hash, token_ids) -> None:
        self.heard.append((self.name, "stored", medium, block_id))

    def block_evicted(self, medium, block_id, entry, is_kv_intact) -> None:
        self.heard.append((self.name, "evicted", medium, block_id))

    def pool_cleared(self, medium) -> None:
        self.heard.append((self.name, "cleared", medium, None))

    def step_ended(self, next_step) -> None:
        self.heard.append((self.name, "step", None, next_step))


def test_an_empty_fan_out_hears_nothing_and_every_base_event_is_a_no_op() -> None:
    fan_out = KVListeners()
    assert len(fan_out) == 0 and list(fan_out) == []
    fan_out.step_ended(1)
    fan_out.block_spilled(3)
    fan_out.prefix_hit("r", 0, [1], 2, None)
    fan_out.add(KVListener())  # hears everything, does nothing
    fan_out.table_forked("r", 1, 0, [1, 2])
    fan_out.block_copied_on_write("r", 0, 1, 2)


def test_listeners_are_called_in_order_observers_before_reactors() -> None:
    heard: list[tuple] = []
    fan_out = KVListeners()
    reactor, first, second = (Recording(name, heard) for name in ("reactor", "a", "b"))
    fan_out.add(reactor, reacts=True)
    fan_out.add(first)
    fan_out.add(second)
    assert list(fan_out) == [first, second, reactor]
    fan_out.step_ended(7)
    assert heard == [("a", "step", None, 7), ("b", "step", None, 7),
                     ("reactor", "step", None, 7)]


def test_a_listener_is_registered_once_and_unregistered_hears_nothing() -> None:
    heard: list[tuple] = []
    fan_out = KVListeners()
    listener = Recording("a", heard)
    fan_out.add(listener)
    with pytest.raises(AssertionError):
        fan_out.add(listener, reacts=True)
    fan_out.remove(listener)
    assert listener not in fan_out
    fan_out.step_ended(1)
    assert heard == []
    with pytest.raises(ValueError):
        fan_out.remove(listener)


def test_a_pool_emits_stored_evicted_and_cleared_with_its_medium() -> None:
    heard: list[tuple] = []
    pool = BlockPool(2, LAYOUT, medium=HOST)
    pool.listeners.add(Recording("a", heard))
    table = SequenceBlocks(pool)
    table.append_tokens([1, 2, 3, 4])  # two full blocks: both published
    table.free()  # cached, tail first
    pool.allocate(1)  # evicts the least recently used: the tail block
    assert heard == [("a", "stored", HOST, 1), ("a", "stored", HOST, 2),
                     ("a", "evicted", HOST, 2)]
    assert list(pool.recent_evictions) == [hash_full_blocks([1, 2, 3, 4], 2)[1]]
    pool.free([2])
    pool.reset()
    assert heard[-1] == ("a", "cleared", HOST, None)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it (type-only and function-local too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_memory_imports_nothing_above_it() -> None:
    memory = Path(__file__).parents[2] / "kvpool" / "memory"
    upward = {f"{path.relative_to(memory)} -> {name}"
              for path in memory.rglob("*.py") for name in _imports(path)
              if name.startswith(ABOVE_MEMORY)}
    assert not upward
