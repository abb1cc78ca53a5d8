"""Keys and tenants through the router: the replicas' key file gives the same tenants, a bad
or missing key is refused with 401 before anything is routed, the client's key reaches the
replica unchanged, and tenants' prefixes are kept apart: tenant B's identical prompt is not
routed by tenant A's blocks (nor hits them on the replica)."""

from __future__ import annotations

import httpx
import pytest

from kvpool.openai.auth import ApiKeyTable
from kvpool.openai.middleware import AccessPolicy
from kvpool.server.config import ServerConfig
from tests.router.conftest import start_router, wait_for_blocks
from tests.server.conftest import MODEL

PROMPT = list(range(300, 350))  # 3 full blocks of 16
ALICE, BOB, ADMIN = ({"Authorization": f"Bearer {key}"} for key in ("key-a", "key-b", "root"))


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("alice:key-a\nbob:key-b\n")
    return path


def complete(router_url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{router_url}/v1/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})


def test_tenants_keep_their_prefixes_apart(make_replica, fast_model, key_file) -> None:
    keys = ApiKeyTable.from_config(api_key_file=key_file)
    admin = ApiKeyTable.from_keys([("admin", "root")])
    server_config = ServerConfig(served_model_names=(MODEL,), api_keys=keys,
                                 admin_api_keys=admin)
    replicas = [make_replica(server_config), make_replica(server_config)]
    with start_router([replica.base_url for replica in replicas], fast_model.tokenizer,
                      access=AccessPolicy(keys=keys, admin_keys=admin),
                      replica_admin_key="root") as router:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = complete(router.base_url, headers)
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{router.base_url}/v1/router/replicas", headers=ALICE).status_code \
            == 403

        first = complete(router.base_url, ALICE)
        assert first.status_code == 200  # alice's key reached the replica
        [(served, reason)] = router.decisions(**ADMIN)
        assert reason == "load"
        wait_for_blocks(router, served, 3)
        again = complete(router.base_url, ALICE)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert router.decisions(**ADMIN)[served, "prefix"] == 1
        as_bob = complete(router.base_url, BOB)
        assert as_bob.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        decisions = router.decisions(**ADMIN)
        assert sum(count for (_, reason), count in decisions.items() if reason == "load") == 2
        assert decisions[served, "prefix"] == 1  # bob's went by load: alice's is not his
        metrics = router.metrics(**ADMIN)
        assert metrics["kvpool_router_prefix_matched_tokens_total"] == 48
