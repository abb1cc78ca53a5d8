"""The health-check loop: every `health_check_interval` seconds, GET /health on each replica.

A check fails on anything but a 200 within `health_check_timeout` (a refused connection, a
timeout, a 503 from a replica whose engine died or that is shutting down).
`num_failures_to_remove` failures in a row take a replica out; one success brings it back
(`ReplicaSet.bring_in`, which also restarts its KV-event feed). The replicas are checked
concurrently, and one round ends before the next begins, so a replica is never checked twice
at once.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from kvpool.router.config import RouterConfig
from kvpool.router.replicas import Replica, ReplicaSet

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, replicas: ReplicaSet, client: httpx.AsyncClient, config: RouterConfig
                 ) -> None:
        self.replicas = replicas
        self.client = client
        self.config = config

    async def run(self) -> None:
        """Check every replica every interval (the first after one interval), until
        cancelled."""
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(replica) for replica in self.replicas))

    async def check(self, replica: Replica) -> None:
        failure = await self._probe(replica.url)
        if failure is None:
            replica.num_failed_checks = 0
            if replica.is_healthy:
                await self.replicas.ensure_subscribed(replica)
            else:
                await self.replicas.bring_in(replica)
            return
        replica.num_failed_checks += 1
        if replica.is_healthy and replica.num_failed_checks >= self.config.num_failures_to_remove:
            self.replicas.take_out(replica, f"{replica.num_failed_checks} failed health checks "
                                            f"({failure})")

    async def _probe(self, url: str) -> str | None:
        """None if /health answers 200, else what went wrong."""
        try:
            response = await self.client.get(f"{url}/health",
                                             timeout=self.config.health_check_timeout)
        except httpx.HTTPError as error:
            return type(error).__name__
        return None if response.status_code == 200 else f"status {response.status_code}"
