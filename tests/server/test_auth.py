"""API keys, tenants and prefix-cache isolation: unit checks of `kvpool.openai.auth`, then the
real server: 401 without or with a wrong key (and no work done), /health and /ping open, one
tenant never hitting another's cached prefix while a client salt only narrows sharing, and the
keys `kvpool serve` takes from repeated `--api-key` flags or the environment."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import openai
import pytest

from kvpool.cli import build_parser
from kvpool.cli.serve import server_config_from_args
from kvpool.engine.errors import InvalidRequestError
from kvpool.openai.auth import ApiKeyTable, TenantSalts, parse_key_file
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL

KEY_FILE = "# tenants\nalice: key-alice\n\nbob:key-bob\n"
PROMPT = "The archive keeps every letter the harbour master ever wrote, " * 3


def test_key_file_lines_name_tenants() -> None:
    assert parse_key_file(KEY_FILE) == [("alice", "key-alice"), ("bob", "key-bob")]
    with pytest.raises(ValueError, match="line 2: expected 'tenant:key'"):
        parse_key_file("alice:key\nno-separator\n")
    with pytest.raises(ValueError, match="line 1"):
        parse_key_file(":key-without-tenant")


def test_authenticate_finds_the_tenant_of_a_bearer_key() -> None:
    table = ApiKeyTable.from_keys(parse_key_file(KEY_FILE))
    assert table.authenticate("Bearer key-alice") == "alice"
    assert table.authenticate("bearer key-bob") == "bob"
    assert table.authenticate("Bearer key-carol") is None
    assert table.authenticate("Basic key-alice") is None
    assert table.authenticate("Bearer ") is None
    assert table.authenticate(None) is None
    assert not ApiKeyTable().is_enabled


def test_a_key_may_come_as_x_api_key_when_there_is_no_authorization_header() -> None:
    table = ApiKeyTable.from_keys(parse_key_file(KEY_FILE))
    assert table.authenticate(None, "key-alice") == "alice"  # Anthropic's x-api-key
    assert table.authenticate("Bearer key-bob", "key-alice") == "bob"  # Authorization wins
    assert table.authenticate("Bearer key-carol", "key-alice") is None
    assert table.authenticate(None, " ") is None


def test_api_key_and_key_file_combine(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(KEY_FILE)
    table = ApiKeyTable.from_config(["key-default", "key-other"], path)
    names = ("default", "other", "alice")
    assert [table.authenticate(f"Bearer key-{name}") for name in names] == [
        "default", "default", "alice"
    ]
    assert ApiKeyTable.from_config("key-default").authenticate("Bearer key-default") == "default"


def test_cache_salt_is_the_tenant_narrowed_by_the_client() -> None:
    salts = TenantSalts(b"s" * 32)
    assert salts.cache_salt("alice", None).startswith("alice\0")
    derived = {
        salts.cache_salt(tenant, client)
        for tenant in ("alice", "bob")
        for client in (None, "", "x", "bob")
    }
    assert len(derived) == 8  # no (tenant, client salt) pair collides with another
    with pytest.raises(ValueError, match="at most 256"):
        salts.cache_salt("alice", "s" * 257)
    with pytest.raises(InvalidRequestError, match="valid Unicode") as refused:
        salts.cache_salt("alice", "x\ud800")  # a lone surrogate cannot be hashed
    assert refused.value.param == "cache_salt"


@pytest.fixture
def server(make_server, tmp_path: Path):
    path = tmp_path / "keys.txt"
    path.write_text(KEY_FILE)
    keys = ApiKeyTable.from_config(None, path)
    return make_server(ServerConfig(served_model_names=(MODEL,), api_keys=keys))


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
     ("GET", "/metrics"), ("GET", "/v1/kv/stats"), ("GET", "/openapi.json"), ("GET", "/nope"),
     ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")],
)
def test_every_route_but_health_needs_a_key(server, method: str, path: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "messages": messages,
            "tokens": [1, 2]}
    if path == "/tokenize":  # takes a prompt or messages, not both
        del body["messages"]
    with httpx.Client(base_url=server.base_url) as http:
        missing = http.request(method, path, json=body)
        wrong = http.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
        right = http.request(method, path, json=body, headers={"Authorization": "Bearer key-bob"})
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["code"] == wrong.json()["error"]["code"] == 401
    assert "no API key given" in missing.json()["error"]["message"]
    assert "incorrect API key" in wrong.json()["error"]["message"]
    assert missing.headers["www-authenticate"] == "Bearer"
    assert right.status_code == (404 if path == "/nope" else 200)


def test_health_is_open_and_refused_requests_do_no_work(server) -> None:
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/ping").json() == {"status": "ok"}
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model=MODEL, prompt=PROMPT)
    snapshot = server.engine.snapshot()
    assert snapshot.stats.num_prompt_tokens == 0
    assert snapshot.memory.num_allocations == 0


def test_tenants_never_share_a_cached_prefix(server) -> None:
    def cached(key: str, salt: str | None = None) -> int:
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
        completion = server.client(api_key=key).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extra
        )
        return completion.usage.prompt_tokens_details.cached_tokens

    assert cached("key-alice") == 0
    assert cached("key-alice") > 0  # the same tenant hits its own prefix
    assert cached("key-bob") == 0  # another tenant misses it: it can't hit (or time) it
    assert cached("key-bob") > 0
    assert cached("key-alice", salt="project-x") == 0  # a client salt narrows ...
    assert cached("key-alice", salt="project-x") > 0
    assert cached("key-bob", salt="project-x") == 0  # ... and never widens across tenants
    assert cached("key-alice") > 0


def test_the_openai_client_sees_the_status_as_the_error_code(server) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        server.client(api_key="wrong").models.list()
    assert refused.value.body["code"] == 401  # the body keeps the integer
    assert refused.value.code == "401"  # the client's `code` attribute is a string


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "tiny", "--load-format", "dummy", *flags])


def test_repeated_api_keys_each_open_the_server_as_the_default_tenant(make_server) -> None:
    config = server_config_from_args(serve_args("--api-key", "key-one", "--api-key", "key-two"))
    server = make_server(dataclasses.replace(config, served_model_names=(MODEL,)))

    def cached(key: str) -> int:
        completion = server.client(api_key=key).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"ignore_eos": True})
        return completion.usage.prompt_tokens_details.cached_tokens

    assert cached("key-one") == 0
    assert cached("key-two") > 0  # one tenant: the second key hits the first's prefix
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="key-three").models.list()


@pytest.mark.parametrize(
    ("env", "accepted", "refused"),
    [({"VLLM_API_KEY": "key-vllm"}, "key-vllm", "key-kvpool"),
     ({"KVPOOL_API_KEY": "key-kvpool", "VLLM_API_KEY": "key-vllm"}, "key-kvpool", "key-vllm")],
)
def test_the_api_key_can_come_from_the_environment(
    make_server, monkeypatch, env: dict[str, str], accepted: str, refused: str
) -> None:
    for name in ("KVPOOL_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = server_config_from_args(serve_args())
    server = make_server(dataclasses.replace(config, served_model_names=(MODEL,)))
    assert [card.id for card in server.client(api_key=accepted).models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key=refused).models.list()
    with httpx.Client(base_url=server.base_url) as http:
        assert http.get("/v1/models").status_code == 401


def test_an_api_key_flag_overrides_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "key-vllm")
    keys = server_config_from_args(serve_args("--api-key", "key-flag")).api_keys
    assert keys.authenticate("Bearer key-flag") == "default"
    assert keys.authenticate("Bearer key-vllm") is None
