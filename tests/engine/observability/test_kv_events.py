"""KV events from a real engine (SmolLM2), received on a real ZMQ SUB socket: a prompt's
chain with its parents and tokens, evictions, spills to the host tier, a reset; and an
engine with events off binds nothing and hooks nothing; by default the events carry hashes
only, never a prompt's tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.engine.observability.event_log import KVEventLog
from kvpool.engine.sampling_params import SamplingParams
from kvpool.formats.kv_events import (
    DEVICE,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_message,
)
from kvpool.memory.prefix_cache import hash_full_blocks, salt_key
from kvpool.router.prefix_index import PrefixIndex

EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "topic": "kv",
          "include_token_ids": True}
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
A = list(range(1000, 1017))  # 17 tokens: four full blocks of 4, computed by the prefill
B = list(range(2000, 2017))


class Subscriber:
    """A SUB socket on the engine's endpoint, connected before anything is published."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.socket.connect(endpoint)
        assert monitor.poll(5000), "no connection to the publisher"
        recv_monitor_message(monitor)
        self.socket.disable_monitor()
        monitor.close(linger=0)
        time.sleep(0.1)  # the subscription reaches the PUB socket (ZMQ's slow joiner)

    def receive(self, num_batches: int) -> list[tuple[int, KVEventBatch]]:
        received = []
        for _ in range(num_batches):
            assert self.socket.poll(5000), f"only {len(received)} of {num_batches} batches"
            frames = self.socket.recv_multipart()
            assert frames[0] == b"kv"
            received.append(decode_message(frames))
        assert not self.socket.poll(100), "more batches than expected"
        return received

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture
def subscriber_to() -> Iterator:
    subscribers: list[Subscriber] = []

    def connect(engine) -> Subscriber:
        subscribers.append(Subscriber(engine.kv_events.publisher.endpoint))
        return subscribers[-1]

    yield connect
    for subscriber in subscribers:
        subscriber.close()


def run(engine, prompt: list[int], cache_salt: str | None = None,
        params: SamplingParams = ONE_TOKEN) -> None:
    engine.add_request(prompt, params, cache_salt=cache_salt)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_prompt_publishes_its_chain_and_a_branch_names_its_parent(make_engine,
                                                                     subscriber_to) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=32, enable_warmup=False,
                         kv_events_config=EVENTS)
    subscriber = subscriber_to(engine)
    run(engine, A, "tenant-1", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    branch = A[:8] + [7] * 9
    run(engine, branch, "tenant-1")
    chain = hash_full_blocks(A, 4, salt_key("tenant-1"))
    branch_chain = hash_full_blocks(branch, 4, salt_key("tenant-1"))
    # Decode steps that fill no block publish nothing: two batches, numbered from 1.
    assert subscriber.receive(2) == [
        (1, KVEventBatch(pytest.approx(time.time(), abs=60), [
            BlockStored(chain, None, A[:16], 4, None, DEVICE)])),
        (2, KVEventBatch(pytest.approx(time.time(), abs=60), [
            BlockStored(branch_chain[2:], chain[1], branch[8:16], 4, None, DEVICE)])),
    ]
    assert engine.kv_events.publisher.stats().num_events_published == 2


def test_by_default_a_subscriber_gets_hashes_and_no_token_ids(make_engine,
                                                               subscriber_to) -> None:
    # Issue 28: any subscriber decoded another tenant's prompt from `token_ids`.
    hashes_only = {key: value for key, value in EVENTS.items() if key != "include_token_ids"}
    engine = make_engine(block_size=4, num_gpu_blocks=32, enable_warmup=False,
                         kv_events_config=hashes_only)
    subscriber = subscriber_to(engine)
    run(engine, A, "tenant-1")
    chain = hash_full_blocks(A, 4, salt_key("tenant-1"))
    [(seq, batch)] = subscriber.receive(1)
    assert seq == 1 and batch.events == [BlockStored(chain, None, [], 4, None, DEVICE)]


def test_evictions_are_removed_and_the_batches_rebuild_the_cache(make_engine,
                                                                  subscriber_to) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=8, enable_warmup=False,
                         kv_events_config=EVENTS)
    subscriber = subscriber_to(engine)
    run(engine, A)
    run(engine, B)  # 5 blocks from 3 fresh + A's unhashed tail + A's last cached block
    a_chain, b_chain = hash_full_blocks(A, 4), hash_full_blocks(B, 4)
    batches = subscriber.receive(2)
    assert batches[1][1].events == [BlockRemoved([a_chain[3]], DEVICE),
                                    BlockStored(b_chain, None, B[:16], 4, None, DEVICE)]
    index = PrefixIndex()
    for _, batch in batches:
        index.apply(batch)
    snapshot = engine.kv_events.snapshot()
    assert snapshot.seq == 2 and index.blocks() == set(snapshot.blocks)
    assert index.longest_prefix(a_chain) == 3 and index.longest_prefix(b_chain) == 4


def test_a_spill_is_stored_on_the_host_with_its_parent(make_engine, subscriber_to) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=8, enable_warmup=False,
                         swap_space=4 * engine_block_gib(), kv_events_config=EVENTS)
    assert engine.kv_tiers.host is not None
    subscriber = subscriber_to(engine)
    run(engine, A)
    run(engine, B)
    a_chain = hash_full_blocks(A, 4)
    events = subscriber.receive(2)[1][1].events
    assert events[:2] == [BlockRemoved([a_chain[3]], DEVICE),
                          BlockStored([a_chain[3]], a_chain[2], A[12:16], 4, None, HOST)]
    assert (a_chain[3], HOST) in engine.kv_events.snapshot().blocks


def test_a_reset_is_all_blocks_cleared(make_engine, subscriber_to) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=32, enable_warmup=False,
                         kv_events_config=EVENTS)
    subscriber = subscriber_to(engine)
    run(engine, A)
    engine.reset_stats()
    engine.resize_kv_pool()  # between steps: what is pending is published
    assert [batch.events for _, batch in subscriber.receive(2)][1] == [AllBlocksCleared()]
    assert engine.kv_events.snapshot().blocks == []


def test_events_off_bind_nothing_and_hook_nothing(make_engine) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=8, enable_warmup=False,
                         swap_space=4 * engine_block_gib())
    run(engine, A)
    assert engine.kv_events is None
    for pool in (engine.kv_memory.pool, engine.kv_tiers.host.pool):
        assert not any(isinstance(getattr(listener, "log", None), KVEventLog)
                       for listener in pool.listeners)


def test_close_sends_what_is_pending_and_frees_the_port(make_engine, subscriber_to) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=32, enable_warmup=False,
                         kv_events_config=EVENTS)
    subscriber = subscriber_to(engine)
    run(engine, A)
    engine.reset_stats()  # pending until the next drain: close's
    endpoint = engine.kv_events.publisher.endpoint
    engine.close()
    assert subscriber.receive(2)[1][1].events == [AllBlocksCleared()]
    socket = zmq.Context.instance().socket(zmq.PUB)
    socket.bind(endpoint)  # the port is free again
    socket.close(linger=0)


def engine_block_gib() -> float:
    """SmolLM2's fp32 KV for one block of 4 tokens, in GiB (30 layers, 3 KV heads of 64)."""
    return 30 * 2 * 4 * 3 * 64 * 4 / 2**30
