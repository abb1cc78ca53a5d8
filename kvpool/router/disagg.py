"""The bodies of a disaggregated request's two hops, as vLLM's disaggregation proxy sends them.

    prefill hop   the client's body with "stream": false, no "stream_options", "max_tokens": 1
                  ("max_completion_tokens": 1 and "n": 1 where the client gave them), none of
                  what asks for more than the prompt's KV (`DECODE_ONLY`: a minimum length,
                  logprobs, echo, beam search), and `REMOTE_DECODE` as its
                  "kv_transfer_params": compute the prompt, and keep its blocks for a decode
                  worker to read
    its answer    an OpenAI response with a top-level "kv_transfer_params": null (nothing to
                  hand over, e.g. a prompt shorter than one block) or an object the router
                  passes on without reading
    decode hop    the client's body as it came (its stream flag, max_tokens, ...) with that
                  object as its "kv_transfer_params"; after null, the body byte for byte (the
                  decode worker computes the prompt itself)

Pure functions of bytes and JSON: the hops themselves are `kvpool.router.disagg_forward`'s.
"""

from __future__ import annotations

import json
from typing import Any

# Fields that shape the output, not the prompt's KV: the decode hop honours them; on the
# prefill hop they would only make its one token refused (min_tokens > 1) or cost work.
DECODE_ONLY = frozenset({"min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo",
                         "use_beam_search", "best_of", "length_penalty"})
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def parse_request(body: bytes) -> dict[str, Any] | None:
    """The client's request as a JSON object; None for a body that is not one (it cannot be
    split into hops: a decode worker answers it whole, with the real error)."""
    try:
        data = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        return None
    return data if isinstance(data, dict) else None


def prefill_body(request: dict[str, Any]) -> bytes:
    """The prefill hop's body for the client's `request` (module docstring)."""
    body = {key: value for key, value in request.items()
            if key != "stream_options" and key not in DECODE_ONLY}
    body.update(stream=False, max_tokens=1, kv_transfer_params=dict(REMOTE_DECODE))
    for key in ("max_completion_tokens", "n"):
        if key in body:
            body[key] = 1
    return json.dumps(body).encode()


def kv_transfer_params(answer: bytes) -> dict[str, Any] | None:
    """What a prefill worker's whole 2xx `answer` hands to the decode worker; ValueError for
    an answer that is not a JSON object, or whose params are neither null nor an object."""
    data = json.loads(answer)
    if not isinstance(data, dict):
        raise ValueError("its answer is not a JSON object")
    params = data.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"its kv_transfer_params is a {type(params).__name__}, not an object")
    return params


def decode_body(body: bytes, request: dict[str, Any], params: dict[str, Any] | None) -> bytes:
    """The decode hop's body: the client's `body` (parsed: `request`) with the prefill's
    `params`, or `body` itself when there are none."""
    if params is None:
        return body
    return json.dumps({**request, "kv_transfer_params": params}).encode()
