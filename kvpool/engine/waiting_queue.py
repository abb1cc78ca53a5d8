"""The scheduler's waiting queue: sequences not running, in scheduling order.

A binary heap keyed by `Sequence.sort_key` (priority, then arrival, then sequence id, so keys
are unique and sequences are never compared). Push and pop are O(log n); removing a sequence
from anywhere (an abort) is O(1): `discard` only forgets it, and its heap entry is dropped when
it reaches the head. A server with tens of thousands of queued prompts can abort them all in
linear time.

Invariants: `len(queue)` counts the live (not discarded) sequences, each on the heap exactly
once; every heap entry that is not live belongs to a finished sequence; `_num_by_request` counts
the live sequences of each request (so the number of waiting requests is O(1)).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvpool.engine.sequence import Sequence

_Entry = tuple[tuple[int, float, int], Sequence]


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._live: set[int] = set()  # seq ids
        self._num_by_request: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._live

    def __iter__(self) -> Iterator[Sequence]:
        """Live sequences in scheduling order (O(n log n); for tests and reports)."""
        live = sorted((e for e in self._heap if e[1].seq_id in self._live), key=lambda e: e[0])
        return iter([seq for _, seq in live])

    @property
    def num_requests(self) -> int:
        """Requests with at least one waiting sequence."""
        return len(self._num_by_request)

    def push(self, seq: Sequence) -> None:
        assert seq.seq_id not in self._live, "a sequence waits at most once"
        heapq.heappush(self._heap, (seq.sort_key, seq))
        self._live.add(seq.seq_id)
        request_id = seq.request.request_id
        self._num_by_request[request_id] = self._num_by_request.get(request_id, 0) + 1

    def peek(self) -> Sequence | None:
        """The first live sequence in scheduling order, or None."""
        heap = self._heap
        while heap and heap[0][1].seq_id not in self._live:
            heapq.heappop(heap)  # discarded earlier: drop the stale entry now
        return heap[0][1] if heap else None

    def pop(self) -> Sequence:
        seq = self.peek()
        assert seq is not None, "pop from an empty waiting queue"
        heapq.heappop(self._heap)
        self._forget(seq)
        return seq

    def discard(self, seq: Sequence) -> bool:
        """Forget `seq` if it waits (O(1)); returns whether it did."""
        if seq.seq_id not in self._live:
            return False
        self._forget(seq)
        return True

    def _forget(self, seq: Sequence) -> None:
        self._live.discard(seq.seq_id)
        request_id = seq.request.request_id
        self._num_by_request[request_id] -= 1
        if not self._num_by_request[request_id]:
            del self._num_by_request[request_id]
