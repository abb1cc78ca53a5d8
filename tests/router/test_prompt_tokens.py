"""The router's block hashes are the replica's: for every way a prompt can arrive (text with or
without special tokens, token ids, a batch, a chat with tools and a system message, a client
cache_salt, a tenant's key), the hashes `prompt_key` computes are exactly among the blocks the
replica holds after running it, per its own KV-event snapshot; and another tenant's are not.
Whatever cannot be read is UNMATCHED (routed by load), never an error."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvpool.openai.auth import DEFAULT_TENANT, ApiKeyTable, TenantSalts
from kvpool.router.prompt_tokens import CHAT_PATH, COMPLETIONS_PATH, UNMATCHED, prompt_key
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL

BLOCK_SIZE = 16
SALTS = TenantSalts.resolve()  # the suite's secret (tests/conftest.py), as the replicas'
STORY = ("Once upon a time, in a valley between two rivers, there lived a clockmaker who "
         "built a clock that ran backwards, and the whole town came to see it.")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def held_hashes(base_url: str, headers: dict[str, str] | None = None) -> set[bytes]:
    response = httpx.get(f"{base_url}/v1/kv/events/snapshot", headers=headers, timeout=10)
    response.raise_for_status()
    return {bytes.fromhex(block["hash"]) for block in response.json()["blocks"]}


def run_and_hash(base_url: str, path: str, body: dict[str, Any], tokenizer: Any,
                 tenant: str = DEFAULT_TENANT, headers: dict[str, str] | None = None
                 ) -> tuple[bytes, ...]:
    """Run `body` on the replica; the router's hashes for it."""
    response = httpx.post(f"{base_url}{path}", json={**body, "max_tokens": 1},
                          headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    key = prompt_key(path, json.dumps(body).encode(), tenant, tokenizer, None, BLOCK_SIZE,
                     SALTS)
    assert key.num_prompt_tokens == response.json()["usage"]["prompt_tokens"]
    assert len(key.block_hashes) >= 2
    return key.block_hashes


REQUESTS = {
    "text": (COMPLETIONS_PATH, {"prompt": STORY}),
    "text without special tokens": (COMPLETIONS_PATH,
                                    {"prompt": STORY, "add_special_tokens": False}),
    "token ids": (COMPLETIONS_PATH, {"prompt": list(range(100, 140))}),
    "chat": (CHAT_PATH, {"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": STORY}]}),
    "chat with tools": (CHAT_PATH, {"messages": [{"role": "user", "content": "Paris?"}],
                                    "tools": TOOLS}),
    "client cache_salt": (COMPLETIONS_PATH, {"prompt": STORY, "cache_salt": "s1"}),
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_the_router_hashes_what_the_replica_holds(make_replica, fast_model, name) -> None:
    replica = make_replica()
    path, body = REQUESTS[name]
    hashes = run_and_hash(replica.base_url, path, {"model": MODEL, **body},
                          fast_model.tokenizer)
    assert set(hashes) <= held_hashes(replica.base_url)


def test_a_batch_is_keyed_by_its_first_prompt(make_replica, fast_model) -> None:
    replica = make_replica()
    body = {"model": MODEL, "prompt": [STORY, "A different second prompt entirely."]}
    response = httpx.post(f"{replica.base_url}{COMPLETIONS_PATH}", timeout=30,
                          json={**body, "max_tokens": 1})
    assert response.status_code == 200, response.text
    batch = prompt_key(COMPLETIONS_PATH, json.dumps(body).encode(), DEFAULT_TENANT,
                       fast_model.tokenizer, None, BLOCK_SIZE, SALTS)
    alone = prompt_key(COMPLETIONS_PATH, json.dumps({"prompt": STORY}).encode(),
                       DEFAULT_TENANT, fast_model.tokenizer, None, BLOCK_SIZE, SALTS)
    assert batch == alone and len(batch.block_hashes) >= 2
    assert set(batch.block_hashes) <= held_hashes(replica.base_url)


def test_a_tenant_key_salts_as_the_replica_salts(make_replica, fast_model, tmp_path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("alice:key-a\nbob:key-b\n")
    config = ServerConfig(served_model_names=(MODEL,),
                          api_keys=ApiKeyTable.from_config(api_key_file=key_file),
                          admin_api_keys=ApiKeyTable.from_keys([("admin", "root")]))
    replica = make_replica(config)
    body = {"model": MODEL, "prompt": STORY}
    hashes = run_and_hash(replica.base_url, COMPLETIONS_PATH, body, fast_model.tokenizer,
                          tenant="alice", headers={"Authorization": "Bearer key-a"})
    held = held_hashes(replica.base_url, {"Authorization": "Bearer root"})
    assert set(hashes) <= held
    as_bob = prompt_key(COMPLETIONS_PATH, json.dumps(body).encode(), "bob",
                        fast_model.tokenizer, None, BLOCK_SIZE, SALTS)
    assert not set(as_bob.block_hashes) & held


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS_PATH, b"not json"),
    (COMPLETIONS_PATH, b'{"prompt": []}'),
    (COMPLETIONS_PATH, b'{"prompt": "x", "cache_salt": 7}'),
    (CHAT_PATH, b'{"messages": "not a list"}'),
    (CHAT_PATH, b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",'
                b' "tools": [{"type": "nope"}]}'),
])
def test_what_cannot_be_read_is_unmatched(fast_model, path, body) -> None:
    assert prompt_key(path, body, DEFAULT_TENANT, fast_model.tokenizer, None,
                      BLOCK_SIZE, SALTS) is UNMATCHED


def test_without_a_tokenizer_only_token_ids_are_keyed() -> None:
    text = json.dumps({"prompt": STORY}).encode()
    assert prompt_key(COMPLETIONS_PATH, text, DEFAULT_TENANT, None, None, 4,
                      SALTS) is UNMATCHED
    ids = json.dumps({"prompt": [1, 2, 3, 4, 5, 6, 7, 8]}).encode()
    assert len(prompt_key(COMPLETIONS_PATH, ids, DEFAULT_TENANT, None, None, 4, SALTS)
               .block_hashes) == 2
