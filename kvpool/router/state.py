"""`RouterState`: what the router's routes share (on `app.state.router`), and the routing
decision itself: a request's prompt key, matched against every healthy replica's index, handed
to the policy, recorded in the metrics.

Hashing is skipped where nothing could use it: under round-robin, and before any replica has
reported a block size (no index holds anything yet).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kvpool.router.config import RouterConfig
from kvpool.router.metrics import RouterMetrics
from kvpool.router.policy import Candidate, Choice, Policy, make_policy
from kvpool.router.prompt_tokens import UNMATCHED, PromptKey, prompt_key
from kvpool.router.proxy import Proxy
from kvpool.router.replicas import ReplicaSet


@dataclass
class RouterState:
    config: RouterConfig
    replicas: ReplicaSet
    metrics: RouterMetrics
    proxy: Proxy
    tokenizer: Any  # the replicas' tokenizer, None if there is none (text goes by load)
    policy: Policy

    @classmethod
    def build(cls, config: RouterConfig, replicas: ReplicaSet, proxy: Proxy,
              tokenizer: Any) -> RouterState:
        return cls(config, replicas, proxy.metrics, proxy, tokenizer,
                   make_policy(config.policy, config.max_load_imbalance))

    def prompt_key(self, path: str, body: bytes, tenant: str) -> PromptKey:
        """The request's key (blocking: tokenizes; run it in a worker thread)."""
        block_size = self.replicas.block_size
        if self.config.policy != "prefix" or block_size is None:
            return UNMATCHED
        return prompt_key(path, body, tenant, self.tokenizer, self.config.chat_template,
                          block_size, self.config.tenant_salts)

    def choose(self, key: PromptKey, excluded: Collection[str]) -> Choice | None:
        """A routing decision among the healthy replicas not in `excluded`, recorded."""
        candidates = [Candidate(replica.url, replica.num_matched_blocks(key.block_hashes),
                                replica.num_in_flight)
                      for replica in self.replicas.healthy() if replica.url not in excluded]
        choice = self.policy.choose(candidates)
        if choice is not None:
            self.metrics.record_choice(choice, key, self.replicas.block_size)
        return choice

    def any_replica(self, excluded: Collection[str]) -> Choice | None:
        """The least loaded healthy replica, not recorded as a decision (for /v1/models)."""
        candidates = [replica for replica in self.replicas.healthy()
                      if replica.url not in excluded]
        if not candidates:
            return None
        replica = min(candidates, key=lambda replica: replica.num_in_flight)
        return Choice(replica.url, "load", 0)
