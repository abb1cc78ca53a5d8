"""`read_metrics` (`LLM.get_metrics()`) for engines with a KV connector: one handover counted
on both sides under the `kvpool:kv_transfer_*` names, the load histogram cumulative as vLLM's
records have it, and nothing of the kind for an engine without a connector."""

from __future__ import annotations

from kvpool.engine.kv_connector.errors import FAILURE_REASONS
from kvpool.engine.kv_connector.stats import LOAD_SECONDS_BUCKETS
from kvpool.engine.metrics_reader import Counter, Gauge, Histogram, Metric, read_metrics
from tests.engine.conftest import run_all
from tests.engine.kv_connector.loopback_pair import (
    CONSUMER,
    NUM_HANDED_OVER,
    PRODUCER,
    PROMPT,
    decode,
    prefill,
)

OPTIONS = {"num_gpu_blocks": 32, "enable_warmup": False}


def by_name_and_tags(metrics: list[Metric]) -> dict[tuple[str, ...], Metric]:
    """Each record under (name, its tag values other than model_name and engine)."""
    return {(m.name, *(v for k, v in m.tags.items() if k not in ("model_name", "engine"))): m
            for m in metrics}


def transfer_values(engine) -> dict[tuple[str, ...], float]:
    """The counters' and gauges' values among the kv_transfer records."""
    return {key: m.value for key, m in by_name_and_tags(read_metrics(engine, "m")).items()
            if key[0].startswith("kvpool:kv_transfer_") and isinstance(m, Counter | Gauge)}


def test_one_handover_is_counted_on_both_sides(make_fast_engine):
    producer = make_fast_engine(**OPTIONS, kv_transfer_config=PRODUCER)
    consumer = make_fast_engine(**OPTIONS, kv_transfer_config=CONSUMER)
    handover = prefill(producer)
    live = transfer_values(producer)
    assert live[("kvpool:kv_transfer_live_leases",)] == 1
    assert live[("kvpool:kv_transfer_leased_blocks",)] == NUM_HANDED_OVER
    assert live[("kvpool:kv_transfer_leases", "granted")] == 1
    assert live[("kvpool:kv_transfer_leases", "released")] == 0

    decode(consumer, handover)
    producer.resize_kv_pool()  # the tick that ends the released lease
    num_bytes = NUM_HANDED_OVER * producer.kv_memory.layout.bytes_per_block
    zero_failures = {("kvpool:kv_transfer_failures", reason): 0 for reason in FAILURE_REASONS}
    common = {**zero_failures, ("kvpool:kv_transfer_live_leases",): 0,
              ("kvpool:kv_transfer_leased_blocks",): 0,
              ("kvpool:kv_transfer_loads_in_flight",): 0,
              ("kvpool:kv_transfer_leases", "expired"): 0}
    assert transfer_values(producer) == {
        **common, ("kvpool:kv_transfer_blocks", "sent"): NUM_HANDED_OVER,
        ("kvpool:kv_transfer_blocks", "received"): 0,
        ("kvpool:kv_transfer_bytes", "sent"): num_bytes,
        ("kvpool:kv_transfer_bytes", "received"): 0,
        ("kvpool:kv_transfer_leases", "granted"): 1,
        ("kvpool:kv_transfer_leases", "released"): 1}
    assert transfer_values(consumer) == {
        **common, ("kvpool:kv_transfer_blocks", "sent"): 0,
        ("kvpool:kv_transfer_blocks", "received"): NUM_HANDED_OVER,
        ("kvpool:kv_transfer_bytes", "sent"): 0,
        ("kvpool:kv_transfer_bytes", "received"): num_bytes,
        ("kvpool:kv_transfer_leases", "granted"): 0,
        ("kvpool:kv_transfer_leases", "released"): 0}

    histogram = by_name_and_tags(read_metrics(consumer, "m"))[("kvpool:kv_transfer_seconds",)]
    assert isinstance(histogram, Histogram)
    assert histogram.count == 1 and histogram.sum > 0
    assert list(histogram.buckets) == [*map(str, LOAD_SECONDS_BUCKETS), "+Inf"]
    counts = list(histogram.buckets.values())
    assert counts == sorted(counts) and counts[-1] == 1  # cumulative: one load in some bucket
    assert histogram.tags == {"model_name": "m", "engine": "0"}


def test_an_engine_without_a_connector_has_no_transfer_metrics(make_fast_engine):
    engine = make_fast_engine(**OPTIONS)
    run_all(engine, [PROMPT])
    names = {metric.name for metric in read_metrics(engine, "m")}
    assert "kvpool:num_steps" in names
    assert not {name for name in names if name.startswith("kvpool:kv_transfer_")}
