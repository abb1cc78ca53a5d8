"""/v1/kv/snapshot, /v1/kv/explain and /dashboard over real HTTP, with two tenants and an admin.

While one request of each tenant is streaming: a tenant's snapshot lists only its own
sequences and shows the other's blocks as "other"; the admin's lists both; no key gets 401.
At rest the snapshot's counts are /v1/kv/stats' counts. Explain finds a prompt sent before
(for its sender only; the admin learns that another salt holds it), and refuses bad bodies
naming the parameter. The dashboard is one page that loads nothing from elsewhere."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from kvpool.cli import build_parser
from kvpool.cli.serve import server_config_from_args
from kvpool.engine.async_engine import EngineClosedError
from kvpool.formats.kv_snapshot import BLOCK_STATES, KVSnapshot
from kvpool.inspect.palette import BLOCK_COLOURS
from kvpool.openai.auth import ADMIN_TENANT, ApiKeyTable, TenantSalts, tenant_of_salt
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, RunningServer, serve, slow_steps

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
PROMPT = "The lighthouse keeper wrote down every ship that passed the northern cape, " * 2


@pytest.fixture(scope="module")
def server(fast_model) -> Iterator[RunningServer]:
    config = ServerConfig(
        served_model_names=(MODEL,),
        api_keys=ApiKeyTable.from_keys([("alice", ALICE), ("bob", BOB)]),
        admin_api_keys=ApiKeyTable.from_keys([(ADMIN_TENANT, ADMIN)]),
    )
    with serve(fast_model, config, num_gpu_blocks=64) as running:
        slow_steps(running, 0.01)  # a 400-token stream lasts seconds, not milliseconds
        yield running


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def snapshot_of(server: RunningServer, key: str) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/v1/kv/snapshot", headers=bearer(key), timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    return response.json()


@contextmanager
def streaming(server: RunningServer, key: str) -> Iterator[None]:
    """A long completion of `key`'s tenant, in flight (its first token out) until the end of
    the block; leaving closes the connection, which aborts it."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http, http.stream(
            "POST", "/v1/completions", json=body, headers=bearer(key)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept open: a closed iterator closes the connection
        while not next(lines).startswith("data:"):
            pass
        yield


def states(doc: dict[str, Any]) -> dict[str, int]:
    counts = dict.fromkeys(BLOCK_STATES, 0)
    for _, count, state, *_ in doc["pools"]["device"]["runs"]:
        counts[state] += count
    return counts


def test_a_tenant_sees_its_own_requests_and_the_others_blocks_as_other(server) -> None:
    with ExitStack() as stack:
        stack.enter_context(streaming(server, ALICE))
        stack.enter_context(streaming(server, BOB))
        admin, alice, bob = (snapshot_of(server, key) for key in (ADMIN, ALICE, BOB))
    tenants = {seq["request_id"]: seq["tenant"] for seq in admin["sequences"]}
    assert sorted(tenants.values()) == ["alice", "bob"]
    assert states(admin)["other"] == 0
    for view, tenant in ((alice, "alice"), (bob, "bob")):
        own = [seq["request_id"] for seq in view["sequences"]]
        assert own == [rid for rid, owner in tenants.items() if owner == tenant]
        assert {seq["tenant"] for seq in view["sequences"]} == {tenant}
        assert states(view)["other"] > 0  # the other tenant's blocks, unnamed
        for _, _, state, _, _, holders in view["pools"]["device"]["runs"]:
            assert all(h < len(own) for h in holders)
            assert state != "other" or holders == []
        # Counts stay whole in every view: "other" is a share of "used", nothing more.
        assert states(view)["used"] + states(view)["other"] == view["stats"]["num_used_blocks"]
    KVSnapshot.from_json(alice)  # still a valid snapshot document


def test_the_snapshot_needs_a_key_and_the_admin_key_opens_every_route(server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        missing = http.get("/v1/kv/snapshot")
        wrong = http.get("/v1/kv/snapshot", headers=bearer("nope"))
        assert missing.status_code == wrong.status_code == 401
        assert missing.json()["error"]["code"] == 401
        assert http.post("/v1/kv/explain", json={"prompt": "hi"}).status_code == 401
        assert http.get("/metrics", headers=bearer(ADMIN)).status_code == 200
        assert http.get("/v1/models", headers=bearer(ADMIN)).status_code == 200
        completion = http.post("/v1/completions", headers=bearer(ADMIN),
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert completion.status_code == 200  # an admin may generate, as tenant "admin"


def test_the_snapshot_counts_agree_with_kv_stats(server) -> None:
    server.client(api_key=ALICE).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    stats = server.wait_until_idle(Authorization=f"Bearer {ADMIN}")
    doc = snapshot_of(server, ADMIN)
    counts = states(doc)
    assert counts["free"] == stats["num_free_blocks"]
    assert counts["cached"] == stats["num_cached_blocks"] > 0  # the prompt stays cached
    assert counts["used"] == stats["num_used_blocks"] == 0
    assert doc["stats"]["num_blocks"] == stats["num_blocks"] == 64
    assert doc["stats"]["prefix_cache_hits_tokens"] == stats["prefix_cache_hits_tokens"]


def explain(server: RunningServer, key: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/kv/explain", json=body, headers=bearer(key),
                      timeout=30)


def test_explain_finds_a_prompt_sent_before_for_its_sender_only(server) -> None:
    prompt = "A second, different prompt about tidal charts and the harbour's old pilots. " * 2
    before = explain(server, ALICE, prompt=prompt)
    assert before.status_code == 200, before.text
    assert before.json()["num_hit_tokens"] == 0
    server.client(api_key=ALICE).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    server.wait_until_idle(Authorization=f"Bearer {ADMIN}")
    after = explain(server, ALICE, prompt=prompt).json()
    assert after["num_hit_tokens"] > 0
    assert after["verdicts"][0]["verdict"] == "hit"
    token_ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt},
                           headers=bearer(ALICE)).json()["tokens"]
    assert explain(server, ALICE, prompt_token_ids=token_ids).json() == after
    narrowed = explain(server, ALICE, prompt=prompt, cache_salt="project-x").json()
    assert narrowed["num_hit_tokens"] == 0  # a client salt narrows the sharing
    bob = explain(server, BOB, prompt=prompt).json()
    assert bob["num_hit_tokens"] == 0
    assert bob["verdicts"][0]["verdict"] == "never_seen"  # not told that alice sent it
    admin = explain(server, ADMIN, prompt=prompt).json()
    assert admin["verdicts"][0]["verdict"] == "salt_differs"  # the admin is told


@pytest.mark.parametrize(
    ("body", "param"),
    [({}, "prompt"),
     ({"prompt": "hi", "prompt_token_ids": [1, 2]}, "prompt"),
     ({"prompt": ""}, "prompt"),
     ({"prompt": 5}, "prompt"),
     ({"prompt_token_ids": []}, "prompt_token_ids"),
     ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
     ({"prompt_token_ids": [10**8]}, "prompt_token_ids"),  # past the vocabulary
     ({"prompt_token_ids": [1] * 10_000}, "prompt_token_ids"),  # past max_model_len
     ({"prompt": "hi", "cache_salt": "s" * 257}, "cache_salt")],
)
def test_explain_refuses_a_bad_body_naming_the_param(server, body, param: str) -> None:
    response = explain(server, ALICE, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["code"] == 400


def test_the_dashboard_is_one_page_that_loads_nothing_from_elsewhere(server) -> None:
    response = httpx.get(f"{server.base_url}/dashboard", timeout=30)  # no key: the page asks
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "://" not in page and not re.search(r"\b(src|href)\s*=", page)
    assert 'id="block-grid"' in page and "__KVPOOL_" not in page
    config = re.search(r'<script id="dashboard-config" type="application/json">(.*?)</script>',
                       page, re.S)
    assert config is not None
    assert json.loads(config.group(1))["states"] == BLOCK_COLOURS
    assert set(BLOCK_COLOURS) == set(BLOCK_STATES)  # every state has its colour


def test_tenant_of_salt_reads_back_the_derived_salt() -> None:
    for tenant in ("alice", "admin", "a b"):
        for client in (None, "", "x", "x\x00y"):
            assert tenant_of_salt(TenantSalts.resolve().cache_salt(tenant, client)) == tenant
    assert tenant_of_salt(None) is None


def test_admin_keys_come_from_the_flag_and_the_admin_name_is_reserved() -> None:
    args = build_parser().parse_args(["serve", "tiny", "--load-format", "dummy",
                                      "--admin-api-key", "one", "--admin-api-key", "two"])
    config = server_config_from_args(args)
    assert config.admin_api_keys.authenticate("Bearer two") == ADMIN_TENANT
    assert not config.api_keys.is_enabled
    with pytest.raises(ValueError, match="reserved"):
        ServerConfig(api_keys=ApiKeyTable.from_keys([(ADMIN_TENANT, "k")]))


def test_calls_on_a_closed_engine_raise(fast_model) -> None:
    with serve(fast_model, num_gpu_blocks=16) as running:
        engine = running.engine

        async def failing() -> None:
            await engine.call_on_engine(lambda _: 1 / 0)

        with pytest.raises(ZeroDivisionError):  # the caller's error, the engine goes on
            asyncio.run(failing())
        assert engine.is_healthy
        assert asyncio.run(engine.kv_snapshot()).device.num_blocks == 16
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.kv_snapshot())
