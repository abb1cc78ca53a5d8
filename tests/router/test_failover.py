"""The router in front of real `kvpool serve` processes, as a real `kvpool router` process: a
conversation's second turn lands on the replica that served its first (by the prefix its KV
events reported), and when that replica is killed (SIGKILL, the router not yet told), the
third turn still succeeds: the connection is refused before the first byte, the router takes
the replica out and sends the turn to the other, and its metrics count the one retry. A
replica killed in the middle of a stream is not retried: the client's stream breaks off (it
never looks complete), and with no replica left the router answers 503.

The replicas serve the random-weight `tiny` preset (it starts fastest; it has no tokenizer,
so the conversation is token ids, each turn the previous prompt plus new tokens).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.kvpool_processes import start_kvpool as start
from tests.kvpool_processes import wait_healthy

KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": "tcp://127.0.0.1:*"})
TURN_1 = list(range(1, 41))  # 2 full blocks of 16
TURN_2 = TURN_1 + list(range(41, 61))  # 3 full blocks
TURN_3 = TURN_2 + list(range(61, 81))



@pytest.fixture
def cluster(tmp_path) -> Iterator[tuple[str, dict[str, subprocess.Popen]]]:
    """Two replicas and a router over them, all started together: (router url, url ->
    replica process). The router checks health every 0.2 s, so the replicas come in as soon
    as they answer, but takes one out only after 1000 failed checks: it learns of a death
    from the request that meets it."""
    processes: list[subprocess.Popen] = []
    try:
        replicas, logs = {}, {}
        for index in range(2):
            logs[index] = tmp_path / f"replica{index}.log"
            process, url = start(["serve", "tiny", "--load-format", "dummy",
                                  "--num-gpu-blocks", "64", "--no-enable-warmup",
                                  "--kv-events-config", KV_EVENTS], logs[index])
            processes.append(process)
            replicas[url] = process
        router_log = tmp_path / "router.log"
        router, router_url = start(["router", *(f"--replica={url}" for url in replicas),
                                    "--model", "tiny", "--health-check-interval", "0.2",
                                    "--health-check-failures", "1000"], router_log)
        processes.append(router)
        for index, (url, process) in enumerate(replicas.items()):
            wait_healthy(process, url, logs[index])
        wait_healthy(router, router_url, router_log)
        deadline = time.monotonic() + 20
        while not all(status["is_healthy"] and status["events"]
                      for status in replica_status(router_url).values()):
            assert time.monotonic() < deadline, router_log.read_text()[-2000:]
            time.sleep(0.05)
        yield router_url, replicas
    finally:
        for process in processes:
            process.kill()
            process.wait()


def complete(router_url: str, prompt: list[int]) -> dict:
    response = httpx.post(f"{router_url}/v1/completions", timeout=60,
                          json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def counters(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of `name` on `url`'s /metrics, by their sorted labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {tuple(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name}


def replica_status(router_url: str) -> dict[str, dict]:
    replicas = httpx.get(f"{router_url}/v1/router/replicas", timeout=10).json()["replicas"]
    return {replica["url"]: replica for replica in replicas}


def decisions(router_url: str) -> dict[tuple[str, str], float]:
    return {(dict(labels)["replica"], dict(labels)["reason"]): value
            for labels, value in counters(router_url, "kvpool_router_requests_total").items()
            if value}


def test_the_next_turn_follows_its_prefix_and_survives_killed_replicas(cluster) -> None:
    router_url, replicas = cluster
    complete(router_url, TURN_1)
    [(first, reason)] = decisions(router_url)
    assert reason == "load"
    [other] = set(replicas) - {first}
    deadline = time.monotonic() + 20
    while replica_status(router_url)[first]["events"]["num_blocks"] < 2:
        assert time.monotonic() < deadline, "the first turn's blocks never reached the router"
        time.sleep(0.05)

    second = complete(router_url, TURN_2)
    assert decisions(router_url) == {(first, "load"): 1, (first, "prefix"): 1}
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert counters(first, "kvpool:prefix_cache_hits_total")[(("model_name", "tiny"),)] >= 32

    replicas[first].send_signal(signal.SIGKILL)
    replicas[first].wait()
    assert replica_status(router_url)[first]["is_healthy"]  # not told yet
    third = complete(router_url, TURN_3)
    assert third["usage"]["prompt_tokens"] == len(TURN_3)
    assert decisions(router_url) == {(first, "load"): 1, (first, "prefix"): 2,
                                     (other, "load"): 1}
    assert counters(router_url, "kvpool_router_retries_total") == {(): 1}
    errors = counters(router_url, "kvpool_router_upstream_errors_total")
    assert errors[(("kind", "connect"), ("replica", first))] == 1
    status = replica_status(router_url)
    assert not status[first]["is_healthy"] and "ConnectError" in status[first]["error"]
    assert status[other]["is_healthy"]
    assert httpx.get(f"{router_url}/health", timeout=10).status_code == 200

    long_stream = {"prompt": TURN_1, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router_url}/v1/completions", json=long_stream,
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        replicas[other].send_signal(signal.SIGKILL)
        replicas[other].wait()
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in lines:
                pass
    errors = counters(router_url, "kvpool_router_upstream_errors_total")
    assert errors[(("kind", "stream"), ("replica", other))] == 1
    assert counters(router_url, "kvpool_router_retries_total") == {(): 1}  # none for it
    assert httpx.get(f"{router_url}/health", timeout=10).status_code == 503
    refused = httpx.post(f"{router_url}/v1/completions", json={"prompt": TURN_1}, timeout=10)
    assert refused.status_code == 503
