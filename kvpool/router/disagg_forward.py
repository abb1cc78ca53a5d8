"""`forward_disaggregated`: a generation request in two hops, prefill on one worker, then decode
on another (`kvpool router --prefill URL ... --decode URL ...`; the bodies are
`kvpool.router.disagg`'s).

    no decode worker in     503 at once (a prefill's blocks would wait for a decode that
                            never comes)
    body not a JSON object  straight to a decode worker, as a plain replica gets it (it gives
                            the real error)
    prefill hop             to the prefill worker `RouterState.choose` picks (the prefix-aware
                            policy over the prefill workers), its answer read whole; a client
                            that leaves meanwhile cancels it (the worker sees the connection
                            close and aborts the request)
      2xx                   its kv_transfer_params go on to the decode hop
      4xx                   returned to the client as it came: the request is at fault, and
                            no decode worker is called
      5xx, refused, reset   once more on another prefill worker, then 502 (also when there is
                            no other); an answer that is not the contract's JSON: 502
      timeout               504
    decode hop              `Proxy.forward` to the least loaded decode worker: its answer,
                            streamed or whole, reaches the client as a plain replica's does
                            (one retry before any byte; a client leaving closes it)

`kvpool_router_prefill_duration_seconds` times the prefill hop of every request it answered.
"""

from __future__ import annotations

import time
from functools import partial

import httpx
from starlette.requests import Request
from starlette.responses import Response

from kvpool.openai.errors import OpenAIError
from kvpool.router.disagg import decode_body, kv_transfer_params, parse_request, prefill_body
from kvpool.router.prompt_tokens import UNMATCHED, PromptKey
from kvpool.router.proxy import ClientGone, Hop, whole_response
from kvpool.router.state import RouterState

PREFILL = Hop("prefill worker", is_whole=True, is_5xx_retried=True, is_502_when_alone=True)


async def forward_disaggregated(state: RouterState, request: Request, body: bytes,
                                key: PromptKey) -> Response:
    """The decode worker's response to `request` after its prefill (module docstring); the
    prefill's own answer when it refused the request."""
    if not state.replicas.serving("decode"):
        state.metrics.no_replica.inc()
        raise OpenAIError(503, "no decode worker is available; try again later",
                          headers={"Retry-After": "1"})
    choose_decode = partial(state.choose, "decode", UNMATCHED)
    data = parse_request(body)
    if data is None:
        return await state.proxy.forward(request, body, choose_decode)
    try:
        answer = await _prefill(state, request, data, key)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it: the client has gone
    if not answer.is_success:
        return whole_response(answer)
    params = _read_params(answer)
    return await state.proxy.forward(request, decode_body(body, data, params), choose_decode)


async def _prefill(state: RouterState, request: Request, data: dict, key: PromptKey
                   ) -> httpx.Response:
    """The prefill worker's whole answer (any status but 5xx)."""
    started = time.monotonic()
    exchange = await state.proxy.exchange(request, prefill_body(data),
                                          partial(state.choose, "prefill", key), PREFILL)
    state.metrics.prefill_seconds.observe(time.monotonic() - started)
    return exchange.upstream


def _read_params(answer: httpx.Response) -> dict | None:
    try:
        return kv_transfer_params(answer.content)
    except ValueError as error:
        raise OpenAIError(502, f"the prefill worker's answer breaks the contract: {error}"
                          ) from error
