"""Disaggregated serving as a user runs it: `kvpool serve` processes as a prefill worker
(kv_producer) and a decode worker (kv_consumer) handing KV over through the Mooncake transfer
engine on loopback, a `kvpool router --prefill --decode` in front, and a colocated server to
compare with. Greedy answers through the pair are the colocated server's, streamed or not;
the decode worker's prefix cache keeps what it loaded (a repeat reads nothing). Faults, each on
processes of its own: a prefill worker killed after it answered (the decode worker computes
the prompt itself: the same answer), a decode worker killed while it loads (the producer's
lease expires: its pool goes back to idle), a decode worker of another block size (the
handshake refuses it, and it computes the prompt itself).

The workers serve the random-weight `tiny` preset (it starts fastest; same weights in every
process: dummy weights are seeded), so prompts are token ids.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.kvpool_processes import start_kvpool, wait_healthy

PROMPT = list(range(1, 90))  # 5 full blocks of 16 before the last token
LEASE_SECONDS = 3.0
WORKER = ["serve", "tiny", "--load-format", "dummy", "--num-gpu-blocks", "128",
          "--no-enable-warmup"]


def transfer(role: str, **options) -> list[str]:
    config = {"kv_connector": "MooncakeConnector", "kv_role": role, **options}
    return ["--kv-transfer-config", json.dumps(config)]


PRODUCER = transfer("kv_producer",
                    kv_connector_extra_config={"lease_seconds": LEASE_SECONDS})
CONSUMER = transfer("kv_consumer", kv_connector_extra_config={"transfer_timeout_seconds": 10})


class Processes:
    """`kvpool` processes started by a test, killed at its end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.running: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(self, name: str, args: list[str]) -> str:
        log = self.directory / f"{name}.log"
        process, url = start_kvpool(args, log)
        self.running[name] = (process, log)
        return url

    def wait_healthy(self, name: str, url: str) -> None:
        process, log = self.running[name]
        wait_healthy(process, url, log)

    def kill(self, name: str) -> None:
        process, _ = self.running[name]
        process.send_signal(signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        for process, _ in self.running.values():
            process.kill()
            process.wait()


@pytest.fixture
def processes(tmp_path) -> Iterator[Processes]:
    running = Processes(tmp_path)
    try:
        yield running
    finally:
        running.close()


def start_all(processes: Processes, **commands: list[str]) -> dict[str, str]:
    """Start every named command at once, then wait for each: name -> base URL."""
    urls = {name: processes.start(name, args) for name, args in commands.items()}
    for name, url in urls.items():
        processes.wait_healthy(name, url)
    return urls


def complete(url: str, prompt: list[int], **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def streamed_tokens(url: str, prompt: list[int]) -> str:
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [choice["text"] for choice in json.loads(line[6:])["choices"]]
    return "".join(text)


def prefill(url: str, prompt: list[int]) -> dict:
    body = complete(url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert body["kv_transfer_params"]["do_remote_prefill"] is True
    return body["kv_transfer_params"]


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def used_blocks(url: str) -> float:
    return metric(url, "kvpool:num_used_blocks")


def test_through_the_router_answers_match_a_colocated_server(processes) -> None:
    urls = start_all(processes, prefill=WORKER + PRODUCER, decode=WORKER + CONSUMER,
                     colocated=WORKER)
    router = start_all(processes, router=["router", "--prefill", urls["prefill"], "--decode",
                                          urls["decode"], "--model", "tiny"])["router"]
    expected = complete(urls["colocated"], PROMPT)["choices"][0]["text"]
    first = complete(router, PROMPT)
    assert first["choices"][0]["text"] == expected
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * 16
    received = metric(urls["decode"], "kvpool:kv_transfer_blocks_total", direction="received")
    assert received == 5
    assert streamed_tokens(router, PROMPT) == expected  # a repeat: all cached, nothing read
    assert metric(urls["decode"], "kvpool:kv_transfer_blocks_total",
                  direction="received") == received
    for url in (urls["prefill"], urls["decode"]):  # leases released, requests done
        wait_for(lambda url=url: used_blocks(url) == 0, f"{url} idle")
    assert metric(urls["prefill"], "kvpool:kv_transfer_leases_total", outcome="released") == 2


def test_a_killed_prefill_worker_is_recomputed(processes) -> None:
    urls = start_all(processes, prefill=WORKER + PRODUCER, decode=WORKER + CONSUMER,
                     colocated=WORKER)
    handover = prefill(urls["prefill"], PROMPT)
    processes.kill("prefill")
    decoded = complete(urls["decode"], PROMPT, kv_transfer_params=handover)
    assert decoded["choices"][0]["text"] == complete(urls["colocated"], PROMPT)[
        "choices"][0]["text"]
    assert metric(urls["decode"], "kvpool:kv_transfer_failures_total") == 1
    wait_for(lambda: used_blocks(urls["decode"]) == 0, "the decode worker idle")


def test_a_decode_worker_killed_while_loading_strands_nothing(processes) -> None:
    urls = start_all(processes, prefill=WORKER + PRODUCER, decode=WORKER + CONSUMER)
    handover = prefill(urls["prefill"], PROMPT)
    assert used_blocks(urls["prefill"]) == len(handover["remote_block_ids"])
    def send() -> None:
        with contextlib.suppress(httpx.TransportError):  # its server is killed under it
            httpx.post(f"{urls['decode']}/v1/completions", timeout=5, json={
                "prompt": PROMPT, "max_tokens": 400, "kv_transfer_params": handover})

    sender = threading.Thread(target=send)
    sender.start()
    processes.kill("decode")
    sender.join()
    # Whether or not it read and released before dying, the lease ends within its time.
    wait_for(lambda: used_blocks(urls["prefill"]) == 0, "the prefill worker idle",
             timeout=LEASE_SECONDS + 30)
    assert metric(urls["prefill"], "kvpool:kv_transfer_live_leases") == 0
    assert httpx.get(f"{urls['prefill']}/health", timeout=10).status_code == 200


def test_a_decode_worker_of_another_block_size_computes_the_prompt_itself(processes) -> None:
    urls = start_all(processes, prefill=WORKER + PRODUCER,
                     decode=[*WORKER, "--block-size", "32", *CONSUMER])
    handover = prefill(urls["prefill"], PROMPT)
    decoded = complete(urls["decode"], PROMPT, kv_transfer_params=handover)
    plain = complete(urls["decode"], PROMPT)
    assert decoded["choices"][0]["text"] == plain["choices"][0]["text"]
    assert metric(urls["decode"], "kvpool:kv_transfer_failures_total",
                  reason="incompatible") == 1
    assert metric(urls["decode"], "kvpool:kv_transfer_blocks_total", direction="received") == 0
