"""Issue 28, point 2, over real HTTP: a tenant cannot confirm a guess of another tenant's
prompt. Cache salts are keyed with the server's secret, so hashing a guessed prompt under the
other tenant's name finds nothing (it found 2 of 2 blocks before); and a tenant's snapshot
shows no hash, age, LRU position or eviction of blocks its own sequences do not hold."""

from __future__ import annotations

from typing import Any

import httpx

from kvpool.formats.snapshot_runs import expand_hash_runs, short_hash
from kvpool.memory.prefix_cache import hash_full_blocks, salt_key
from kvpool.openai.auth import ADMIN_TENANT, ApiKeyTable, TenantSalts
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, RunningServer

KEY_A, KEY_B, ADMIN = "key-tenant-a", "key-tenant-b", "key-admin"
A_PROMPT = list(range(500, 509))  # two full blocks of 4
SALTS = TenantSalts.resolve()  # the suite's secret (tests/conftest.py), as the server's


def complete(server: RunningServer, prompt: list[int], key: str) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text


def snapshot(server: RunningServer, key: str) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/v1/kv/snapshot", timeout=30,
                         headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def short_hashes(doc: dict[str, Any]) -> set[str]:
    return {label for pool in doc["pools"].values()
            for label in expand_hash_runs(pool["hashes"]).values()}


def test_a_tenant_cannot_confirm_a_guess_of_another_tenants_prompt(make_server) -> None:
    config = ServerConfig(
        served_model_names=(MODEL,),
        api_keys=ApiKeyTable.from_keys([("tenant-a", KEY_A), ("tenant-b", KEY_B)]),
        admin_api_keys=ApiKeyTable.from_keys([(ADMIN_TENANT, ADMIN)]))
    server = make_server(config, block_size=4, num_gpu_blocks=16)
    complete(server, A_PROMPT, KEY_A)
    guessed = {short_hash(h) for h in hash_full_blocks(A_PROMPT, 4, salt_key("tenant-a"))}
    real_salt = salt_key(SALTS.cache_salt("tenant-a", None))
    real = {short_hash(h) for h in hash_full_blocks(A_PROMPT, 4, real_salt)}
    assert len(real) == 2 and real <= short_hashes(snapshot(server, ADMIN))  # cached
    assert not guessed & short_hashes(snapshot(server, ADMIN))  # the name is not the salt
    view = snapshot(server, KEY_B)
    assert short_hashes(view) == set()  # B holds nothing, so it sees no hash at all
    assert view["pools"]["device"]["lru"] == []

    for i in range(6):  # A's other prompts push its first blocks out of the pool
        complete(server, list(range(1000 + 20 * i, 1013 + 20 * i)), KEY_A)
    admin = snapshot(server, ADMIN)
    assert real <= set(admin["recent_evictions"])
    assert admin["pools"]["device"]["lru"]
    view = snapshot(server, KEY_B)
    assert view["recent_evictions"] == [] and view["pools"]["device"]["lru"] == []
    assert short_hashes(view) == set()
    assert all(age is None for _, _, age in view["pools"]["device"]["ages"])
    assert any(age is not None for _, _, age in admin["pools"]["device"]["ages"])
