"""The replicas behind the router: which are in, their load, their roles and prefix indexes.

A replica's `role` is the stage of a request it serves: "both" for a plain replica (`--replica`,
the whole request), "prefill" or "decode" for a disaggregated worker (`--prefill`, `--decode`;
`kvpool.router.disagg_forward`). Decode workers are chosen by load alone, so they get no
KV-event feed (their blocks would never be looked up).

A replica is *in* (routed to) while `is_healthy`. It starts out until its first health check
answers; `num_failures_to_remove` failed checks in a row, or one refused or reset connection on
a forwarded request, take it out; one good check brings it back (`kvpool.router.health`).
Each time a replica comes in, its KV-event feed is started with a fresh index (from the
replica's snapshot), and it is stopped when the replica goes out, so an index never outlives
the replica process it describes; a replica whose feed could not be had is asked again at its
next good check.

Invariants:
- `num_in_flight` counts the requests forwarded to the replica whose response has not ended
  (the proxy adds one before it sends and takes it away exactly once, on every path).
- Every feed in use has the set's `block_size`: the first feed fixes it, and a replica
  reporting another keeps no feed (it is routed by load only, with an error logged and shown
  in its status), since its hashes could never match the router's.

Touched only from the event loop; the feeds' own threads touch only their `PrefixIndex`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvpool.router.replica_events import ReplicaEvents

logger = logging.getLogger(__name__)

Subscribe = Callable[[str], "ReplicaEvents | None"]  # url -> its started feed (blocking)
Role = Literal["both", "prefill", "decode"]


@dataclass(eq=False)
class Replica:
    url: str
    role: Role = "both"
    is_healthy: bool = False
    num_in_flight: int = 0
    num_failed_checks: int = 0  # health checks failed in a row
    events: ReplicaEvents | None = None
    is_subscribed: bool = False  # its feed was asked for since it last came in
    error: str | None = None  # why it is out, or why it has no prefix index

    def serves(self, role: Role) -> bool:
        """Whether it takes requests for `role`'s stage (a plain replica takes every stage)."""
        return self.role in (role, "both")

    def num_matched_blocks(self, block_hashes: Sequence[bytes]) -> int:
        if self.events is None or not block_hashes:
            return 0
        return self.events.index.longest_prefix(block_hashes)

    def status(self) -> dict[str, Any]:
        """What GET /v1/router/replicas shows of it."""
        events = None
        if self.events is not None:
            stats = self.events.stats()
            events = {"block_size": self.events.block_size, "num_blocks": len(self.events.index),
                      "num_batches": stats.num_batches, "num_events": stats.num_events,
                      "num_gaps": stats.num_gaps, "num_resyncs": stats.num_resyncs,
                      "last_seq": stats.last_seq, "is_synced": stats.is_synced}
        return {"url": self.url, "role": self.role, "is_healthy": self.is_healthy,
                "num_in_flight": self.num_in_flight,
                "num_failed_checks": self.num_failed_checks, "error": self.error,
                "events": events}


class ReplicaSet:
    def __init__(self, roles: Mapping[str, Role], subscribe: Subscribe) -> None:
        """`roles`: each replica's url -> its role."""
        self._replicas = {url: Replica(url, role) for url, role in roles.items()}
        self._subscribe = subscribe
        self.block_size: int | None = None  # fixed by the first feed (module docstring)
        self._stopping: set[asyncio.Task[None]] = set()  # feeds of replicas taken out

    def __iter__(self) -> Iterator[Replica]:
        return iter(self._replicas.values())

    def __getitem__(self, url: str) -> Replica:
        return self._replicas[url]

    def healthy(self) -> list[Replica]:
        return [replica for replica in self if replica.is_healthy]

    def serving(self, role: Role) -> list[Replica]:
        """The healthy replicas that take requests for `role`'s stage."""
        return [replica for replica in self.healthy() if replica.serves(role)]

    def take_out(self, replica: Replica, reason: str) -> None:
        """Stop routing to it; its feed is stopped in the background (it would only retry
        a dead replica's snapshot), and started afresh when it comes back."""
        if replica.is_healthy:
            logger.warning("replica %s is out: %s", replica.url, reason)
        replica.is_healthy, replica.error, replica.is_subscribed = False, reason, False
        events, replica.events = replica.events, None
        if events is not None:
            stopping = asyncio.get_running_loop().create_task(asyncio.to_thread(events.stop))
            self._stopping.add(stopping)
            stopping.add_done_callback(self._stopping.discard)

    async def bring_in(self, replica: Replica) -> None:
        """Route to it again once its fresh feed is attached, so it is never healthy with its
        blocks unseen by prefix routing (a refused feed: by load, asked again next check)."""
        logger.info("replica %s is in", replica.url)
        replica.error, replica.num_failed_checks = None, 0
        await self.ensure_subscribed(replica, coming_in=True)
        replica.is_healthy = True

    async def ensure_subscribed(self, replica: Replica, coming_in: bool = False) -> None:
        """Start the replica's feed if it has not been asked for since it came in (never for
        a decode worker: module docstring)."""
        if replica.is_subscribed or replica.role == "decode":
            return
        try:
            events = await asyncio.to_thread(self._subscribe, replica.url)
        except Exception as error:  # unreachable, refused key, ...: asked again next check
            logger.warning("replica %s: no KV events (%s: %s); asking again at its next "
                           "health check", replica.url, type(error).__name__, error)
            return
        if not (replica.is_healthy or coming_in):  # taken out meanwhile: asked when back
            if events is not None:
                await asyncio.to_thread(events.stop)
            return
        replica.is_subscribed = True
        if events is not None and self.block_size not in (None, events.block_size):
            replica.error = (f"its block_size {events.block_size} differs from the other "
                             f"replicas' {self.block_size}: routed by load only")
            logger.error("replica %s: %s", replica.url, replica.error)
            await asyncio.to_thread(events.stop)
            return
        if events is not None:
            self.block_size = events.block_size
        replica.events = events

    async def close(self) -> None:
        """Stop every feed."""
        feeds = [replica.events for replica in self if replica.events is not None]
        for replica in self:
            replica.events = None
        await asyncio.gather(*(asyncio.to_thread(feed.stop) for feed in feeds),
                             *self._stopping)
