"""`RouterState`: what the router's routes share (on `app.state.router`), and the routing
decision itself: a request's prompt key, matched against the index of every healthy replica
serving the stage, handed to that stage's policy, recorded in the metrics.

Policies by role: a plain replica ("both") and a prefill worker by `config.policy` (prefix-aware
by default: that is where prompts are computed), a decode worker by load alone.

Hashing is skipped where nothing could use it: under round-robin, and before any replica has
reported a block size (no index holds anything yet).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kvpool.router.config import RouterConfig
from kvpool.router.metrics import RouterMetrics
from kvpool.router.policy import Candidate, Choice, LeastLoadPolicy, Policy, make_policy
from kvpool.router.prompt_tokens import UNMATCHED, PromptKey, prompt_key
from kvpool.router.proxy import Proxy
from kvpool.router.replicas import ReplicaSet, Role


@dataclass
class RouterState:
    config: RouterConfig
    replicas: ReplicaSet
    metrics: RouterMetrics
    proxy: Proxy
    tokenizer: Any  # the replicas' tokenizer, None if there is none (text goes by load)
    policies: dict[Role, Policy]

    @classmethod
    def build(cls, config: RouterConfig, replicas: ReplicaSet, proxy: Proxy,
              tokenizer: Any) -> RouterState:
        policy = make_policy(config.policy, config.max_load_imbalance)
        policies: dict[Role, Policy] = {"both": policy, "prefill": policy,
                                        "decode": LeastLoadPolicy()}
        return cls(config, replicas, proxy.metrics, proxy, tokenizer, policies)

    def prompt_key(self, path: str, body: bytes, tenant: str) -> PromptKey:
        """The request's key (blocking: tokenizes; run it in a worker thread)."""
        block_size = self.replicas.block_size
        if self.config.policy != "prefix" or block_size is None:
            return UNMATCHED
        return prompt_key(path, body, tenant, self.tokenizer, self.config.chat_template,
                          block_size, self.config.tenant_salts)

    def choose(self, role: Role, key: PromptKey, excluded: Collection[str]) -> Choice | None:
        """A routing decision among the healthy replicas serving `role`'s stage, not in
        `excluded`, recorded."""
        candidates = [Candidate(replica.url, replica.num_matched_blocks(key.block_hashes),
                                replica.num_in_flight)
                      for replica in self.replicas.serving(role) if replica.url not in excluded]
        choice = self.policies[role].choose(candidates)
        if choice is not None:
            self.metrics.record_choice(choice, role, key, self.replicas.block_size)
        return choice

    def any_replica(self, excluded: Collection[str]) -> Choice | None:
        """The least loaded healthy replica that decodes, not recorded as a decision (for
        /v1/models)."""
        candidates = [replica for replica in self.replicas.serving("decode")
                      if replica.url not in excluded]
        if not candidates:
            return None
        replica = min(candidates, key=lambda replica: replica.num_in_flight)
        return Choice(replica.url, "load", 0)
