"""Fetching KV inspection documents from a running kvpool server, with one-line errors.

`fetch_snapshot` reads `GET /v1/kv/snapshot`, `fetch_explanation` posts to `/v1/kv/explain`;
both send `Authorization: Bearer KEY` when a key is given and return the decoded JSON. Every
failure is an `InspectError` (a ValueError, which the command line prints as one line): the
server unreachable, a missing or refused key, a route the server lacks, any other error status
(with the server's own message, `{"error": {"message": ...}}`), a body that is not JSON.
"""

from __future__ import annotations

from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 60.0


class InspectError(ValueError):
    """A request to the server failed; the message says why, in one line."""


def fetch_snapshot(url: str, api_key: str | None,
                   timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The server's KV snapshot document, as this key's tenant may see it."""
    return _request("GET", url, "/v1/kv/snapshot", api_key, None, timeout)


def fetch_explanation(url: str, api_key: str | None, prompt: str, cache_salt: str | None,
                      timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The server's explanation of `prompt` (text, tokenized by the server) under this key's
    tenant salt, narrowed by `cache_salt` as a request's would be."""
    body = {"prompt": prompt, "cache_salt": cache_salt}
    return _request("POST", url, "/v1/kv/explain", api_key, body, timeout)


def _request(method: str, url: str, path: str, api_key: str | None,
             body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.request(method, base + path, json=body, headers=headers,
                                 timeout=timeout)
    except httpx.InvalidURL as error:
        raise InspectError(f"not a server URL: {url!r} ({error})") from None
    except httpx.HTTPError as error:
        reason = str(error) or type(error).__name__
        raise InspectError(f"cannot reach the kvpool server at {base}: {reason}") from None
    if response.status_code == 401:
        raise InspectError(
            f"{base} refused the API key (401): check --api-key or KVPOOL_API_KEY" if api_key
            else f"{base} needs an API key (401): pass --api-key or set KVPOOL_API_KEY")
    if response.status_code == 404:
        raise InspectError(f"{base}{path} was not found (404): is this a kvpool server with "
                           "KV inspection?")
    if response.status_code >= 400:
        raise InspectError(f"{base}{path} answered {response.status_code}: "
                           f"{_error_message(response)}")
    try:
        return response.json()
    except ValueError:
        raise InspectError(f"{base}{path} did not answer JSON") from None


def _error_message(response: httpx.Response) -> str:
    """The server's `error.message`, or the start of the body when it sent something else."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200].strip() or response.reason_phrase
