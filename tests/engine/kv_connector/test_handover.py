"""Handovers between two engines in one process (`LoopbackConnector`): a producer computes a
prompt and leases its blocks, a consumer loads them into its prefix cache and decodes. Every
rule of the real thing holds here (lease check, checksums under the live lease, release), so
the faults are injected by wrapping the consumer's link: corrupted bytes, a read that outlasts
the lease, a producer that vanished, a peer of another KV layout. Each ends in the colocated
engine's answer (policy "recompute") or a clear error (policy "fail"), and both pools go back
to idle (the fixtures check no block leaked and the invariants hold)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest

from kvpool.engine.engine import LLMEngine
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.kv_connector.params import token_digest
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.engine.sampling_params import SamplingParams
from tests.engine.conftest import PROMPTS

BLOCK_SIZE = 16
LONG = [PROMPTS[5], PROMPTS[8], PROMPTS[11], PROMPTS[14]]  # 2 to 40 blocks each


def loopback(role: str, **extra) -> dict:
    return {"kv_connector": "LoopbackConnector", "kv_role": role, **extra}


@pytest.fixture
def pair(make_fast_engine) -> Callable[..., tuple[LLMEngine, LLMEngine]]:
    """(producer, consumer) over the fast model; options apply to both, `producer` /
    `consumer` dicts to one (their kv_transfer_config keys included)."""
    def make(producer: dict | None = None, consumer: dict | None = None, **options):
        producer, consumer = dict(producer or {}), dict(consumer or {})
        made = []
        for role, own in (("kv_producer", producer), ("kv_consumer", consumer)):
            transfer = loopback(role, **own.pop("transfer", {}))
            made.append(make_fast_engine(**{"num_gpu_blocks": 256, "enable_warmup": False,
                                            "kv_transfer_config": transfer, **options, **own}))
        return tuple(made)
    return make


def run(engine: LLMEngine, prompt, params: SamplingParams) -> RequestOutput:
    request_id = engine.add_request(prompt, params).request_id
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output
    assert final is not None
    return final


def greedy(max_tokens: int = 12, handover: dict | None = None) -> SamplingParams:
    extra = None if handover is None else {"kv_transfer_params": handover}
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=extra)


PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill(producer: LLMEngine, prompt) -> dict | None:
    return run(producer, prompt, greedy(1, PREFILL)).kv_transfer_params


def settle(*engines: LLMEngine) -> None:
    """Let producers end released leases (an idle server loop does this every tick)."""
    for engine in engines:
        engine.resize_kv_pool()


def test_greedy_answers_match_a_colocated_engine(pair, make_fast_engine) -> None:
    producer, consumer = pair()
    colocated = make_fast_engine(num_gpu_blocks=256, enable_warmup=False)
    for prompt in [*LONG, PROMPTS[0]]:
        handover = prefill(producer, prompt)
        decoded = run(consumer, prompt, greedy(handover=handover))
        expected = run(colocated, prompt, greedy())
        assert decoded.outputs[0].token_ids == expected.outputs[0].token_ids
        if handover is None:  # shorter than a block and one token: nothing to hand over
            assert len(decoded.prompt_token_ids) <= BLOCK_SIZE
            continue
        num_blocks = (len(decoded.prompt_token_ids) - 1) // BLOCK_SIZE
        assert len(handover["remote_block_ids"]) == num_blocks
        assert decoded.num_cached_tokens == num_blocks * BLOCK_SIZE
    settle(producer)
    sent, received = producer.kv_connector.stats(), consumer.kv_connector.stats()
    assert sent.num_sent_blocks == received.num_received_blocks > 0
    assert sent.num_leases == 0 and sent.num_leases_released == sent.num_leases_granted
    assert received.failures_by_reason == dict.fromkeys(received.failures_by_reason, 0)


def test_the_consumers_prefix_cache_keeps_what_it_loaded(pair) -> None:
    producer, consumer = pair()
    prompt = LONG[0]
    first = run(consumer, prompt, greedy(handover=prefill(producer, prompt)))
    loaded = consumer.kv_connector.stats().num_received_blocks
    # The same prompt again: a handover whose blocks are all cached here loads nothing.
    again = run(consumer, prompt, greedy(handover=prefill(producer, prompt)))
    plain = run(consumer, prompt, greedy())
    settle(producer)
    assert consumer.kv_connector.stats().num_received_blocks == loaded
    assert again.num_cached_tokens == plain.num_cached_tokens == first.num_cached_tokens
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids == first.outputs[0].token_ids
    assert producer.kv_connector.stats().num_leases == 0  # the unread lease was released


def test_only_blocks_missing_here_are_read(pair) -> None:
    producer, consumer = pair()
    short, long = PROMPTS[14], PROMPTS[14] + " " + PROMPTS[5]
    run(consumer, short, greedy())  # its leading blocks are cached here now
    handover = prefill(producer, long)
    decoded = run(consumer, long, greedy(handover=handover))
    settle(producer)
    read = consumer.kv_connector.stats().num_received_blocks
    assert 0 < read < len(handover["remote_block_ids"])
    assert decoded.num_cached_tokens == len(handover["remote_block_ids"]) * BLOCK_SIZE


def wrap_link(consumer: LLMEngine, wrap: Callable) -> None:
    """Every link the consumer makes passes through `wrap(link)`."""
    connector = consumer.kv_connector
    make = connector.consumer._link_for
    connector.consumer._link_for = lambda remote: wrap(make(remote))


class Corrupting:
    """A link whose reads bring one flipped byte."""

    def __init__(self, link, tensors) -> None:
        self.link, self.tensors = link, tensors

    def __getattr__(self, name):
        return getattr(self.link, name)

    def read(self, pairs) -> None:
        self.link.read(pairs)
        block = self.tensors[0][pairs[-1][0]].view(-1).view(dtype=__import__("torch").uint8)
        block[7] ^= 0x10


class Slow:
    """A link whose read finishes only after the producer's lease expired (and the producer
    ticked, ending it)."""

    def __init__(self, link, producer: LLMEngine, lease_seconds: float) -> None:
        self.link, self.producer, self.lease_seconds = link, producer, lease_seconds

    def __getattr__(self, name):
        return getattr(self.link, name)

    def read(self, pairs) -> None:
        self.link.read(pairs)
        time.sleep(self.lease_seconds * 1.5)


CONSUMER_OPTIONS = {"incompatible": {"block_size": 8},
                    "incompatible_dtype": {"kv_cache_dtype": "int8"}}


@pytest.mark.parametrize("fault", ["checksum", "lease", "prompt", "another_prompt", "failed",
                                   "incompatible", "incompatible_dtype"])
def test_a_failed_load_is_recomputed_to_the_same_answer(fault, pair, make_fast_engine) -> None:
    lease_seconds = 0.3
    consumer_options = CONSUMER_OPTIONS.get(fault, {})
    producer, consumer = pair(
        producer={"transfer": {"kv_connector_extra_config": {"lease_seconds": lease_seconds}}},
        consumer=consumer_options)
    prompt = LONG[1]
    handover = prefill(producer, prompt)
    if fault == "another_prompt":  # a lease named for a prompt whose KV it does not hold
        prompt = LONG[1].replace("lamp", "fire")
        tokens = consumer.tokenizer.encode(prompt)
        handover = {**handover, "remote_num_tokens": len(tokens),
                    "remote_token_digest": token_digest(tokens)}
    if fault == "checksum":
        wrap_link(consumer, lambda link: Corrupting(link, consumer.kv_connector.tensors))
    elif fault == "lease":
        wrap_link(consumer, lambda link: Slow(link, producer, lease_seconds))
    elif fault == "prompt":
        handover = {**handover, "remote_token_digest": token_digest([1, 2, 3])}
    elif fault == "failed":  # the producer is gone: no engine answers to its id
        handover = {**handover, "remote_engine_id": "gone"}
    decoded = run(consumer, prompt, greedy(handover=handover))
    if fault == "lease":
        producer.resize_kv_pool()  # the producer's step would end the lease
    colocated = make_fast_engine(num_gpu_blocks=256, enable_warmup=False, **consumer_options)
    assert decoded.outputs[0].token_ids == run(colocated, prompt, greedy()).outputs[0].token_ids
    failures = consumer.kv_connector.stats().failures_by_reason
    reason = {"another_prompt": "lease", "incompatible_dtype": "incompatible"}.get(fault, fault)
    assert failures == {name: int(name == reason) for name in failures}
    assert consumer.kv_connector.stats().num_received_blocks == 0
    time.sleep(lease_seconds)  # leases nobody released expire
    settle(producer)
    assert producer.kv_connector.stats().num_leases == 0


def test_loads_leave_the_admission_watermark_free(pair, make_fast_engine) -> None:
    """A consumer whose free blocks past the watermark cannot hold the handover computes the
    prompt itself, even under policy "fail": it waits for room like any request."""
    producer, consumer = pair(consumer={"num_gpu_blocks": 16, "watermark": 0.85, "transfer": {
        "kv_load_failure_policy": "fail"}})
    prompt = LONG[1]  # 4 blocks to load: 4 + 13 (the watermark) > 16
    decoded = run(consumer, prompt, greedy(handover=prefill(producer, prompt)))
    colocated = make_fast_engine(num_gpu_blocks=256, enable_warmup=False)
    assert decoded.outputs[0].token_ids == run(colocated, prompt, greedy()).outputs[0].token_ids
    assert consumer.kv_connector.stats().failures_by_reason["no_room"] == 1
    settle(producer)


class Stuck:
    """A link whose read returns only when `done` is set (a transfer engine call that
    overran its deadline and still runs)."""

    def __init__(self, link, done: threading.Event) -> None:
        self.link, self.done = link, done

    def __getattr__(self, name):
        return getattr(self.link, name)

    def read(self, pairs) -> None:
        self.done.wait(60)
        self.link.read(pairs)


def test_a_load_past_its_deadline_is_recomputed_and_its_blocks_wait_for_it(
        pair, make_fast_engine) -> None:
    producer, consumer = pair(consumer={"transfer": {"kv_connector_extra_config": {
        "transfer_timeout_seconds": 0.2}}})
    done = threading.Event()
    wrap_link(consumer, lambda link: Stuck(link, done))
    prompt = LONG[0]
    handover = prefill(producer, prompt)
    decoded = run(consumer, prompt, greedy(handover=handover))
    colocated = make_fast_engine(num_gpu_blocks=256, enable_warmup=False)
    assert decoded.outputs[0].token_ids == run(colocated, prompt, greedy()).outputs[0].token_ids
    assert consumer.kv_connector.stats().failures_by_reason["timeout"] == 1
    # The transfer still runs: its destination blocks are held, not handed to anyone.
    stuck = consumer.kv_connector.num_held_blocks
    assert stuck == len(handover["remote_block_ids"])
    done.set()
    deadline = time.monotonic() + 30
    while consumer.kv_connector.num_held_blocks and time.monotonic() < deadline:
        consumer.step()  # each step collects what ended
    assert consumer.kv_connector.num_held_blocks == 0
    settle(producer)


def test_under_policy_fail_a_failed_load_is_an_error(pair) -> None:
    producer, consumer = pair(consumer={"transfer": {"kv_load_failure_policy": "fail"}})
    prompt = LONG[0]
    handover = {**prefill(producer, prompt), "remote_engine_id": "gone"}
    output = run(consumer, prompt, greedy(handover=handover))
    assert output.finished and output.outputs == []
    assert "prefill worker failed" in output.error and "gone" in output.error
    producer.kv_connector.producer.release_later(handover["remote_lease_id"])
    settle(producer)


def test_a_lease_nobody_reads_expires(pair) -> None:
    producer, _ = pair(producer={"transfer": {"kv_connector_extra_config": {
        "lease_seconds": 0.2}}})
    handover = prefill(producer, LONG[2])
    assert producer.memory_stats().num_used_blocks == len(handover["remote_block_ids"])
    time.sleep(0.3)
    settle(producer)
    stats = producer.kv_connector.stats()
    assert (stats.num_leases, stats.num_leases_expired) == (0, 1)
    assert producer.memory_stats().num_used_blocks == 0


@pytest.mark.parametrize("stage", ["prefill", "loading", "decode"])
def test_aborts_free_both_sides(stage, pair) -> None:
    producer, consumer = pair(producer={"max_num_batched_tokens": 32})  # prefills in chunks
    prompt = LONG[2]
    if stage == "prefill":
        request = producer.add_request(prompt, greedy(1, PREFILL))
        producer.step()
        assert producer.abort_request(request.request_id).finished
        assert producer.kv_connector.stats().num_leases_granted == 0
        return
    handover = prefill(producer, prompt)
    request = consumer.add_request(prompt, greedy(handover=handover))
    assert consumer.request_counts() == (0, 1)  # loading (or loaded, not yet scheduled): waits
    if stage == "decode":
        while consumer.kv_connector.has_pending or not request.sequences or not request.sequences[
                0].output_token_ids:
            consumer.step()
    consumer.abort_request(request.request_id)
    while consumer.kv_connector.has_pending or consumer.kv_connector.consumer.num_loading:
        consumer.step()
    settle(producer)
    assert consumer.memory_stats().num_used_blocks == 0
    assert producer.kv_connector.stats().num_leases == 0


def test_several_completions_and_beams_decode_from_a_handover(pair, make_fast_engine) -> None:
    producer, consumer = pair()
    colocated = make_fast_engine(num_gpu_blocks=256, enable_warmup=False)
    prompt = LONG[3]
    for params in (SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8),
                   SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0,
                                  max_tokens=8)):
        handover = prefill(producer, prompt)
        with_handover = dataclasses.replace(params,
                                            extra_args={"kv_transfer_params": handover})
        decoded = run(consumer, prompt, with_handover)
        expected = run(colocated, prompt, params)
        assert [c.token_ids for c in decoded.outputs] == [c.token_ids for c in expected.outputs]
    settle(producer)


def test_requests_an_engine_cannot_honour_are_refused(pair, make_fast_engine) -> None:
    producer, consumer = pair()
    plain = make_fast_engine(num_gpu_blocks=64, enable_warmup=False)
    handover = prefill(producer, LONG[0])
    cases = [
        (plain, greedy(1, PREFILL), "kv-transfer-config"),
        (consumer, greedy(1, PREFILL), "kv_consumer"),
        (producer, greedy(handover=handover), "kv_producer"),
        (consumer, greedy(handover={"do_remote_prefill": True}), "remote_engine_id"),
        (consumer, greedy(handover=[1]), "object"),
    ]
    for engine, params, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            engine.add_request(LONG[0], params)
        assert caught.value.param == "kv_transfer_params"
        assert not engine.requests
    run(consumer, LONG[0], greedy(handover=handover))
    settle(producer)
