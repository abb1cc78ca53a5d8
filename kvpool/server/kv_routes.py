"""The KV inspection routes: `/v1/kv/snapshot`, `/v1/kv/explain` and the `/dashboard` page.

Both data routes run their engine work as a command on the engine thread, between two steps
(`AsyncLLMEngine.call_on_engine`), and everything else (tenant filtering, JSON encoding) in a
worker thread, so neither the event loop nor the engine waits on a 100,000-block serialisation.

Tenant isolation: a snapshot's sequences are tagged with the tenant their cache salt names
(`tenant_of_salt`); a tenant's view lists only its own and shows blocks only others hold as
"other", with the hashes, ages, LRU order and evictions of blocks its sequences do not hold
left out (`KVSnapshot.restricted_to`). An admin key, or a server without keys, sees everything
(`request.state.sees_all_tenants`, set by the middleware); so does `explain` reveal which other
salts hold a prompt's blocks only to them.

The dashboard is one self-contained page (static/dashboard.html and dashboard.js, no external
resources): the block palette (`kvpool.inspect.palette`) and the snapshot's short-hash width are
injected into it here, so the page and every other view of the pool draw states in the same
colours from one definition.
"""

from __future__ import annotations

import asyncio
import json
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse
from pydantic import Field

from kvpool.engine.async_engine import EngineClosedError
from kvpool.engine.errors import InvalidRequestError
from kvpool.formats.kv_snapshot import KVSnapshot
from kvpool.formats.snapshot_runs import SHORT_HASH_BYTES
from kvpool.inspect.explain import explain_prompt
from kvpool.inspect.palette import (
    BACKGROUND_COLOUR,
    BLOCK_COLOURS,
    LEASED_COLOUR,
    SHARED_MARKER_COLOUR,
)
from kvpool.openai.auth import tenant_of_salt
from kvpool.openai.errors import OpenAIError, bad_request
from kvpool.openai.protocol import ErrorResponse, RequestModel, TokenId
from kvpool.server.generation import ServerState

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 503)
}
_NO_STORE = {"Cache-Control": "no-store"}  # per-tenant, and stale a second later

router = APIRouter()


class ExplainRequest(RequestModel):
    """A prompt to explain: text (tokenized as a completion's prompt is) or token ids."""

    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    cache_salt: str | None = None


def _state(request: Request) -> ServerState:
    return request.app.state.kvpool


@router.get("/v1/kv/snapshot", responses=_ERRORS)
async def kv_snapshot(request: Request) -> Response:
    """Every block, block table and derived figure at one instant (format
    "kvpool.kv_snapshot", `kvpool.formats.kv_snapshot`), as this caller may see them."""
    engine = _state(request).engine
    try:
        snapshot = await engine.kv_snapshot()
    except EngineClosedError as error:
        raise OpenAIError(503, "the engine has shut down") from error
    tenant = None if request.state.sees_all_tenants else request.state.tenant
    body = await asyncio.to_thread(_snapshot_body, snapshot, tenant)
    return Response(body, media_type="application/json", headers=_NO_STORE)


def _snapshot_body(snapshot: KVSnapshot, tenant: str | None) -> bytes:
    """The JSON a viewer gets: every tenant's sequences for `tenant` None, else its own."""
    snapshot = snapshot.with_tenants(tenant_of_salt)
    if tenant is not None:
        snapshot = snapshot.restricted_to(lambda seq: seq.tenant == tenant)
    return json.dumps(snapshot.to_json(), separators=(",", ":")).encode()


@router.post("/v1/kv/explain", responses=_ERRORS)
async def kv_explain(body: ExplainRequest, request: Request) -> Response:
    """How much of a prompt the prefix cache holds for this caller's salt, block by block
    (`kvpool.inspect.explain`); nothing is allocated or changed."""
    state = _state(request)
    try:
        salt = state.config.tenant_salts.cache_salt(request.state.tenant, body.cache_salt)
    except InvalidRequestError as error:
        raise bad_request(str(error), error.param) from error
    token_ids = await state.input_work.run(request.state.tenant, _prompt_token_ids, body, state)
    reveal = bool(request.state.sees_all_tenants)
    try:
        explanation = await state.engine.call_on_engine(
            lambda engine: explain_prompt(engine, token_ids, salt, reveal_other_salts=reveal))
    except EngineClosedError as error:
        raise OpenAIError(503, "the engine has shut down") from error
    return Response(json.dumps(explanation.to_json()), media_type="application/json",
                    headers=_NO_STORE)


def _prompt_token_ids(body: ExplainRequest, state: ServerState) -> list[int]:
    """The request's token ids, checked against the model (400 naming the bad param)."""
    if (body.prompt is None) == (body.prompt_token_ids is None):
        raise bad_request("give exactly one of prompt and prompt_token_ids", "prompt")
    if body.prompt_token_ids is not None:
        token_ids, param = list(body.prompt_token_ids), "prompt_token_ids"
        vocab_size = state.engine.engine.model_config.vocab_size
        if max(token_ids) >= vocab_size:
            raise bad_request(f"prompt_token_ids must be in [0, {vocab_size})", param)
    else:
        token_ids, param = _encode(state, body.prompt or ""), "prompt"
        if not token_ids:
            raise bad_request("prompt must not be empty", param)
    if len(token_ids) > state.engine.max_model_len:
        raise bad_request(f"the prompt is longer than the model's {state.engine.max_model_len} "
                          f"tokens", param)
    return token_ids


def _encode(state: ServerState, prompt: str) -> list[int]:
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send prompt_token_ids", "prompt")
    try:
        # As /v1/completions does, text too long for any tokenization refused before it.
        return state.engine.prompt_limits.encode(tokenizer, prompt, add_special_tokens=True)
    except InvalidRequestError as error:
        raise bad_request(str(error), "prompt") from error
    except (ValueError, TypeError) as error:  # e.g. a lone surrogate, not encodable
        raise bad_request("prompt: the text could not be tokenized", "prompt") from error


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    """The live KV map (static/dashboard.html); it asks for a key itself when one is needed."""
    return HTMLResponse(dashboard_html(), headers=_NO_STORE)


@cache
def dashboard_html() -> str:
    """The page with its script and its configuration (palette, hash width) inlined, read
    once."""
    static = resources.files("kvpool.server") / "static"
    config = {"states": BLOCK_COLOURS, "shared": SHARED_MARKER_COLOUR,
              "leased": LEASED_COLOUR, "background": BACKGROUND_COLOUR,
              "short_hash_chars": 2 * SHORT_HASH_BYTES}  # to split the snapshot's "hashes"
    # "<" escaped so no value can close the <script> element it sits in.
    config_json = json.dumps(config).replace("<", "\\u003c")
    page = (static / "dashboard.html").read_text(encoding="utf-8")
    script = (static / "dashboard.js").read_text(encoding="utf-8")
    return page.replace("__KVPOOL_CONFIG__", config_json).replace("__KVPOOL_SCRIPT__", script)
