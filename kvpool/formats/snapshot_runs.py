"""The run encodings of a KV snapshot's JSON form (`kvpool.formats.kv_snapshot`).

A snapshot of a large pool must not cost a Python object per block, in memory or in JSON:
block ids are written as runs `[first, count]`, per-block counts as runs `[first, count, n]`,
and short hashes as one string per run of consecutive hashed ids. `ShortHashes` holds a pool's
labels that way from the start.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

SHORT_HASH_BYTES = 4


def short_hash(block_hash: bytes) -> str:
    """The hex label of a block's chained hash: enough to tell blocks apart on a map, not to
    address them."""
    return block_hash[:SHORT_HASH_BYTES].hex()


class ShortHashes(Mapping[int, str]):
    """Block id -> short hash, stored as sorted ids and one string of their labels: what a
    pool view holds, without a Python string per block until one is asked for."""

    def __init__(self, block_ids: np.ndarray, labels: str) -> None:
        self.block_ids = block_ids  # ascending
        self.labels = labels  # 2 * SHORT_HASH_BYTES hex digits per id, in that order

    def __getitem__(self, block_id: int) -> str:
        index = int(np.searchsorted(self.block_ids, block_id))
        if index == len(self.block_ids) or self.block_ids[index] != block_id:
            raise KeyError(block_id)
        width = 2 * SHORT_HASH_BYTES
        return self.labels[index * width : (index + 1) * width]

    def __iter__(self) -> Iterator[int]:
        return iter(self.block_ids.tolist())

    def __len__(self) -> int:
        return len(self.block_ids)

    def runs(self) -> list[list[Any]]:
        """The JSON form: [[first_id, labels], ...] over runs of consecutive ids."""
        ids, width = self.block_ids, 2 * SHORT_HASH_BYTES
        if not len(ids):
            return []
        starts = np.flatnonzero(np.diff(ids, prepend=-2) != 1).tolist()
        ends = [*starts[1:], len(ids)]
        return [[int(ids[start]), self.labels[start * width : end * width]]
                for start, end in zip(starts, ends, strict=True)]


def hash_runs(hashes: Mapping[int, str]) -> list[list[Any]]:
    """[[first_id, labels], ...]: consecutive hashed ids share one entry (one string, not an
    object per block: a pool of cached prefixes has tens of thousands of them)."""
    if isinstance(hashes, ShortHashes):
        return hashes.runs()
    runs: list[list[Any]] = []
    previous = -2
    for block_id in sorted(hashes):
        if block_id == previous + 1:
            runs[-1][1].append(hashes[block_id])
        else:
            runs.append([block_id, [hashes[block_id]]])
        previous = block_id
    return [[first_id, "".join(labels)] for first_id, labels in runs]


def expand_hash_runs(runs: list[list[Any]]) -> dict[int, str]:
    width = 2 * SHORT_HASH_BYTES
    hashes: dict[int, str] = {}
    for first_id, labels in runs:
        for offset in range(0, len(labels), width):
            hashes[int(first_id) + offset // width] = str(labels[offset : offset + width])
    return hashes


def id_runs(block_ids: tuple[int, ...] | list[int]) -> list[list[int]]:
    """[[first, count], ...] for runs of consecutive ids, in the given order."""
    runs: list[list[int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return runs


def expand_id_runs(runs: list[list[int]]) -> tuple[int, ...]:
    return tuple(block_id for first, count in runs for block_id in range(first, first + count))


def count_runs(counts: Mapping[int, int]) -> list[list[int]]:
    """[[first, count, n], ...]: runs of consecutive ids with the same count n, ascending."""
    runs: list[list[int]] = []
    for block_id in sorted(counts):
        n = counts[block_id]
        if runs and runs[-1][0] + runs[-1][1] == block_id and runs[-1][2] == n:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1, n])
    return runs


def expand_count_runs(runs: list[list[int]]) -> dict[int, int]:
    return {block_id: int(n) for first, count, n in runs
            for block_id in range(int(first), int(first) + int(count))}
