"""`LLMEngine.kv_snapshot()`: after every step of runs that fork, share prefixes, preempt
(recompute and swap) and resize an elastic pool, the snapshot says exactly what the pools and
the sequences' tables say; it survives its JSON form, and a tenant's view hides the others. A
KV producer's leased blocks show, with their lease counts, until the leases end."""

from __future__ import annotations

import json

import pytest

from kvpool.engine.sampling_params import SamplingParams
from kvpool.formats.kv_snapshot import OTHER, USED, KVSnapshot
from tests.engine.conftest import PROMPTS, run_all
from tests.engine.kv_connector.loopback_pair import (
    CONSUMER,
    NUM_HANDED_OVER,
    PRODUCER,
    PROMPT,
    decode,
    prefill,
)
from tests.engine.test_elastic_engine import ELASTIC, ELASTIC_PARAMS, ELASTIC_PROMPTS
from tests.memory.pool_checks import assert_view_matches_pool

SHARED = "You are a careful assistant who answers in one short sentence. " * 4


def check_snapshot(engine) -> KVSnapshot:
    """Take a snapshot and check it against the engine's pools and live sequences."""
    snapshot = engine.kv_snapshot()
    live = {(request.request_id, seq.index): seq for request in engine.requests.values()
            for seq in request.sequences if not seq.is_finished}
    assert {(seq.request_id, seq.index) for seq in snapshot.sequences} == set(live)
    for view in snapshot.sequences:
        assert list(view.block_ids) == live[view.request_id, view.index].block_table.block_ids
    assert_view_matches_pool(snapshot.device, engine.kv_memory.pool,
                             [seq.block_ids for seq in snapshot.sequences])
    host = engine.kv_tiers.host
    assert ("host" in snapshot.pools) == (host is not None)
    if host is not None:
        assert_view_matches_pool(snapshot.pools["host"], host.pool,
                                 [seq.host_block_ids for seq in snapshot.sequences])
    assert snapshot.stats == engine.kv_memory.block_stats()  # the pool's own figures
    assert snapshot.device.leases == engine.kv_connector.leased_block_ids()
    assert snapshot.derived.num_leased_blocks == len(snapshot.device.leases)
    return snapshot


def step_checking(engine) -> list[KVSnapshot]:
    snapshots = [check_snapshot(engine)]
    while engine.has_unfinished_requests():
        engine.step()
        snapshots.append(check_snapshot(engine))
    return snapshots


def test_forks_and_shared_prefixes_show_as_shared_blocks_with_every_holder(make_engine):
    engine = make_engine(num_gpu_blocks=96, enable_warmup=False)
    run_all(engine, [SHARED + "Name a colour."])  # publishes the shared prefix
    engine.add_request(SHARED + "Name a fruit.",
                       SamplingParams(max_tokens=20, n=2, seed=1, ignore_eos=True))
    engine.add_request(SHARED + "Name a river.",
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    snapshots = step_checking(engine)
    shared = [s for s in snapshots if s.derived.num_shared_blocks]
    assert shared, "forks and the cached prefix must show shared blocks"
    widest = max(run.holders for s in shared for run in s.device.runs if run.ref_count > 1)
    assert len(widest) == 3  # two forks of one request and the other request's prefix
    assert 0 < shared[-1].derived.shared_fraction <= 1
    final = snapshots[-1]
    assert final.device.count(USED) == 0 and final.device.lru, "prefixes stay cached"
    # Rates cover the last 10 s of steps: on a loaded machine the final window may no longer
    # hold an allocation, so the run as a whole must have shown one.
    assert any(s.derived.alloc_rate > 0 for s in snapshots) and final.derived.rate_window_s > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_snapshot_exact(make_engine, mode):
    options = {"swap_space": 0.05} if mode == "swap" else {}
    engine = make_engine(num_gpu_blocks=24, max_num_seqs=6, preemption_mode=mode,
                         enable_warmup=False, **options)
    for prompt in PROMPTS[:6]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    snapshots = step_checking(engine)
    assert engine.stats().num_preemptions > 0
    statuses = {seq.status for s in snapshots for seq in s.sequences}
    assert ("swapped" in statuses) == (mode == "swap")
    assert any(s.recent_evictions for s in snapshots), "a small pool evicts cached prefixes"


def test_an_elastic_pool_shows_its_offline_ids_and_resizes(make_engine):
    engine = make_engine(**ELASTIC, num_gpu_blocks=64, enable_warmup=False)
    for prompt, params in zip(ELASTIC_PROMPTS, ELASTIC_PARAMS, strict=True):
        engine.add_request(prompt, params)
    snapshots = step_checking(engine)
    online = [s.device.num_blocks for s in snapshots]
    assert min(online) < max(online), "the pool must have grown (and shrunk) under the run"
    assert all(s.device.count("offline") == s.device.capacity_blocks - s.device.num_blocks
               for s in snapshots)


def test_the_json_form_round_trips_and_refuses_other_versions(make_engine):
    engine = make_engine(num_gpu_blocks=48, enable_warmup=False)
    engine.add_request(SHARED, SamplingParams(max_tokens=4, n=2, seed=0, ignore_eos=True))
    engine.step()
    snapshot = engine.kv_snapshot()
    doc = json.loads(json.dumps(snapshot.to_json(), allow_nan=False))
    assert KVSnapshot.from_json(doc).to_json() == doc
    assert len(doc["pools"]["device"]["runs"]) < doc["pools"]["device"]["capacity_blocks"] / 4
    with pytest.raises(ValueError, match="version 2 is not supported"):
        KVSnapshot.from_json({**doc, "version": 2})
    with pytest.raises(ValueError, match="not a kvpool KV snapshot"):
        KVSnapshot.from_json({"runs": []})
    while engine.has_unfinished_requests():
        engine.step()


def test_a_tenant_view_lists_its_own_sequences_and_hides_the_others(make_engine):
    engine = make_engine(num_gpu_blocks=48, enable_warmup=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(SHARED + "A", params, "a-1", cache_salt="acme")
    engine.add_request(SHARED + "B", params, "b-1", cache_salt="bolt")
    engine.step()
    snapshot = engine.kv_snapshot().with_tenants(lambda salt: salt)
    view = snapshot.restricted_to(lambda seq: seq.tenant == "acme")
    assert [seq.request_id for seq in view.sequences] == ["a-1"]
    bolt_blocks = set(snapshot.sequences[1].block_ids)
    others = {b.block_id for b in view.device.blocks() if b.state == OTHER}
    assert others == bolt_blocks and not others & set(view.device.hashes)
    assert view.device.count(USED) == len(snapshot.sequences[0].block_ids)
    assert "cache_salt" not in json.dumps(view.to_json())
    while engine.has_unfinished_requests():
        engine.step()


def test_a_producers_leased_blocks_show_until_their_leases_end(make_fast_engine):
    options = {"num_gpu_blocks": 32, "enable_warmup": False}
    producer = make_fast_engine(**options, kv_transfer_config=PRODUCER)
    consumer = make_fast_engine(**options, kv_transfer_config=CONSUMER)
    first, second = prefill(producer), prefill(producer)  # the second leases the cached blocks
    leased = first["remote_block_ids"]
    assert second["remote_block_ids"] == leased and len(leased) == NUM_HANDED_OVER
    snapshot = check_snapshot(producer)
    assert snapshot.sequences == ()  # no request holds them: the leases alone do
    assert snapshot.device.leases == dict.fromkeys(leased, 2)
    assert snapshot.derived.num_leased_blocks == NUM_HANDED_OVER
    held = [b for b in snapshot.device.blocks() if b.state == USED]
    assert [(b.block_id, b.ref_count, b.holders, b.num_leases) for b in held] == [
        (block_id, 2, (), 2) for block_id in leased]
    doc = json.loads(json.dumps(snapshot.to_json(), allow_nan=False))
    assert doc["pools"]["device"]["leases"] == [[leased[0], NUM_HANDED_OVER, 2]]
    assert KVSnapshot.from_json(doc) == snapshot
    tenant = snapshot.restricted_to(lambda seq: False)  # nobody's sequence: not "other"
    assert tenant.device.count(USED) == NUM_HANDED_OVER and tenant.device.count(OTHER) == 0
    assert tenant.device.leases == snapshot.device.leases
    assert not set(leased) & set(tenant.device.hashes)

    decode(consumer, first)
    decode(consumer, second)  # cached on the consumer now: it only releases the lease
    producer.resize_kv_pool()  # the tick that ends the leases their reader released
    after = check_snapshot(producer)
    assert after.device.leases == {} and after.derived.num_leased_blocks == 0
    assert after.device.count(USED) == 0 and set(leased) <= set(after.device.lru)
    assert after.to_json()["pools"]["device"]["leases"] == []


def test_a_snapshot_from_before_leases_reads_and_newer_keys_are_skipped(make_fast_engine):
    engine = make_fast_engine(num_gpu_blocks=32, enable_warmup=False)
    run_all(engine, [PROMPTS[0]])
    doc = engine.kv_snapshot().to_json()
    older = json.loads(json.dumps(doc))
    del older["pools"]["device"]["leases"], older["derived"]["num_leased_blocks"]
    assert KVSnapshot.from_json(older).to_json() == doc
    newer = json.loads(json.dumps(doc))
    newer["derived"]["num_future_blocks"] = newer["stats"]["num_future_blocks"] = 7
    assert KVSnapshot.from_json(newer).to_json() == doc


def test_a_consumers_loaded_blocks_show_as_transfer_holds(make_fast_engine):
    """Loaded blocks keep the consumer's reference until their request ends: the snapshot
    counts it with the leases, so every used block's ref_count is still accounted for."""
    options = {"num_gpu_blocks": 32, "enable_warmup": False}
    producer = make_fast_engine(**options, kv_transfer_config=PRODUCER)
    consumer = make_fast_engine(**options, kv_transfer_config=CONSUMER)
    handover = prefill(producer)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            extra_args={"kv_transfer_params": handover})
    request = consumer.add_request(PROMPT, params)
    while not (request.sequences and request.sequences[0].output_token_ids):
        consumer.step()
    snapshot = check_snapshot(consumer)
    loaded = request.sequences[0].block_table.block_ids[:NUM_HANDED_OVER]
    assert snapshot.device.leases == dict.fromkeys(loaded, 1)
    while consumer.has_unfinished_requests():
        consumer.step()
    assert check_snapshot(consumer).device.leases == {}
    producer.resize_kv_pool()
