"""Health checks: a replica that stops answering /health is taken out after
`num_failures_to_remove` failed checks (requests go to the others meanwhile), and one that
answers again on the same address is brought back with a new feed: its index is the new
process's (the old process's blocks are forgotten), and follows its events from then on."""

from __future__ import annotations

from contextlib import ExitStack

import httpx

from kvpool.bench.processes import free_port
from tests.router.conftest import serve_at, start_router, wait_for_blocks, wait_until
from tests.server.conftest import MODEL

PROMPT = list(range(200, 250))  # 3 full blocks of 16


def run_directly(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert response.status_code == 200


def test_a_failed_replica_is_taken_out_and_brought_back_resynced(make_replica, fast_model
                                                                  ) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    other = make_replica()
    first_life = ExitStack()
    first_life.enter_context(serve_at(fast_model, port))
    try:
        with start_router([url, other.base_url], fast_model.tokenizer,
                          health_check_interval=0.1, num_failures_to_remove=2) as router:
            run_directly(url)
            wait_for_blocks(router, url, 3)

            first_life.close()  # the replica stops
            wait_until(lambda: not router.replica_status()[url]["is_healthy"], what="out")
            status = router.replica_status()[url]
            assert status["num_failed_checks"] >= 2
            assert "failed health checks" in status["error"]
            assert router.metrics()[f"kvpool_router_replica_healthy{{replica={url}}}"] == 0
            client = router.client()
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
            # Its KV events reach the router asynchronously: the second request must find
            # them in the index (otherwise it races them and is routed by load again).
            wait_for_blocks(router, other.base_url, 3)
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
            metrics = router.metrics()
            assert metrics[f"kvpool_router_requests_total{{reason=load,replica="
                           f"{other.base_url}}}"] == 1
            assert metrics[f"kvpool_router_requests_total{{reason=prefix,replica="
                           f"{other.base_url}}}"] == 1  # the first left it there
            assert metrics["kvpool_router_retries_total"] == 0

            with serve_at(fast_model, port):  # back, as a new process would be
                wait_until(lambda: router.replica_status()[url]["is_healthy"], what="in")
                events = router.replica_status()[url]["events"]
                assert events is not None and events["num_blocks"] == 0
                run_directly(url)
                wait_for_blocks(router, url, 3)
    finally:
        first_life.close()
