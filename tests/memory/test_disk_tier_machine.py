"""Property test: random interleavings of store, flush, load, damage and restart keep the disk
tier equal to a model of it (which keys have a file, in LRU order) and keep its invariants."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from disk_checks import NAMESPACE, Gate, block_file, file_size, make_block, same_bits
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.tiers.disk_tier import DiskKVTier

SM_LAYOUT = KVLayout(block_size=4, num_layers=1, num_kv_heads=2, head_dim=4, dtype="int8")
SM_KEYS = st.integers(0, 5)
SM_BLOCKS = {key: make_block(SM_LAYOUT, key) for key in range(6)}
SM_MAX_PENDING = 2  # blocks
SM_MAX_FILES = 3


class DiskTierMachine(RuleBasedStateMachine):
    """The model: which keys have a file, in LRU order, which are queued, which are damaged.
    Queued writes wait on a gate until `flush`, so the writer's effects happen exactly there."""

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="disk-tier-")
        self.on_disk: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.pending: list[int] = []
        # key -> the (byte, bit) positions flipped in its file; flipping one twice restores it
        self.damaged: dict[int, set[tuple[int, int]]] = {}
        self.expected = {"num_rejected_files": 0, "num_evicted_files": 0, "num_dropped_writes": 0}
        self.gate = Gate()
        self.tier = self._open()

    def _open(self) -> DiskKVTier:
        if not hasattr(DiskTierMachine, "file_size"):
            DiskTierMachine.file_size = file_size(Path(self.root), SM_LAYOUT)
        block_nbytes = SM_LAYOUT.bytes_per_block
        return DiskKVTier(self.root, SM_MAX_FILES * self.file_size + self.file_size // 2,
                          SM_LAYOUT, NAMESPACE, max_pending_bytes=SM_MAX_PENDING * block_nbytes)

    def _apply_pending(self) -> None:
        for key in self.pending:
            while len(self.on_disk) >= SM_MAX_FILES:
                evicted, _ = self.on_disk.popitem(last=False)
                self.damaged.pop(evicted, None)
                self.expected["num_evicted_files"] += 1
            self.on_disk[key] = None
        self.pending.clear()
        self.gate = Gate()

    @rule(key=SM_KEYS)
    def store(self, key):
        if key not in self.on_disk and key not in self.pending:
            if len(self.pending) >= SM_MAX_PENDING:
                self.expected["num_dropped_writes"] += 1
            else:
                self.pending.append(key)
        self.tier.store(*SM_BLOCKS[key], ready=self.gate)

    @rule()
    def flush(self):
        self.gate.open()
        self.tier.flush()
        self._apply_pending()

    @rule(key=SM_KEYS, wrong_tokens=st.booleans())
    def load(self, key, wrong_tokens):
        block_hash, tokens, kv, scales = SM_BLOCKS[key]
        if wrong_tokens:
            tokens = [*tokens[:-1], 7]
        block = self.tier.load(block_hash, tokens)
        if key not in self.on_disk:
            assert block is None
        elif wrong_tokens or key in self.damaged:
            assert block is None
            del self.on_disk[key]
            self.damaged.pop(key, None)
            self.expected["num_rejected_files"] += 1
        else:
            assert block is not None and same_bits(block.kv, kv) and same_bits(block.scales, scales)
            self.on_disk.move_to_end(key)

    @precondition(lambda self: self.on_disk)
    @rule(data=st.data(), in_header=st.booleans(), bit=st.integers(0, 7))
    def damage(self, data, in_header, bit):
        """Flip one bit of a file, in its header or its tensor payload. The size stays, so the
        index (which records sizes) is still right; truncation is a unit test (test_disk_tier)."""
        key = data.draw(st.sampled_from(sorted(self.on_disk)))
        path = block_file(self.tier, SM_BLOCKS[key][0])
        contents = bytearray(path.read_bytes())
        payload = SM_LAYOUT.bytes_per_block  # the tensors' bytes end the file
        if in_header:
            position = data.draw(st.integers(0, len(contents) - payload - 1))
        else:
            position = len(contents) - 1 - data.draw(st.integers(0, payload - 1))
        contents[position] ^= 1 << bit
        mtime_ns = path.stat().st_mtime_ns  # its recency: damage is not a use
        path.write_bytes(contents)
        os.utime(path, ns=(mtime_ns, mtime_ns))
        flipped = self.damaged.setdefault(key, set())
        flipped ^= {(position, bit)}
        if not flipped:
            del self.damaged[key]

    @rule()
    def restart(self):
        self.gate.open()
        self.tier.close()
        self._apply_pending()
        self.tier = self._open()
        self.expected = dict.fromkeys(self.expected, 0)

    @invariant()
    def tier_matches_the_model(self):
        for key, (block_hash, *_) in SM_BLOCKS.items():
            assert self.tier.contains(block_hash) == (key in self.on_disk), key
        stats = self.tier.stats()
        assert stats.is_enabled and stats.num_files == len(self.on_disk)
        assert {name: getattr(stats, name) for name in self.expected} == self.expected
        if not self.pending:  # queued writes wait on the gate; the tier is quiet otherwise
            self.tier.check_invariants()

    def teardown(self):
        self.gate.open()
        self.tier.close()
        shutil.rmtree(self.root, ignore_errors=True)


DiskTierMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=20, deadline=None
)
TestDiskTierMachine = DiskTierMachine.TestCase
