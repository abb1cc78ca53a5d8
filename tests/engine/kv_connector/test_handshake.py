"""Engine descriptors: the wire form round-trips, and `check_compatible` names the first fact
on which two engines' KV differs, in the documented order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpool import __version__
from kvpool.engine.kv_connector.errors import IncompatibleKVError
from kvpool.engine.kv_connector.handshake import EngineDescriptor, check_compatible
from kvpool.engine.kv_connector.regions import KVRegion, region_block_bytes
from kvpool.memory.kv_layout import KVLayout

LAYOUT = KVLayout(block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def descriptor(layout: KVLayout = LAYOUT, **changes) -> EngineDescriptor:
    regions = tuple(KVRegion(0x1000 * (index + 1) << 20, 10 * size, size)
                    for index, size in enumerate(region_block_bytes(layout)))
    base = EngineDescriptor(engine_id="prefill-0", model="SmolLM2", layout=layout,
                            host="127.0.0.1", rpc_port=15123, regions=regions)
    return replace(base, **changes)


@pytest.mark.parametrize("layout", [LAYOUT, replace(LAYOUT, dtype="int8")], ids=["bf16", "int8"])
def test_the_wire_form_round_trips(layout: KVLayout) -> None:
    original = descriptor(layout)
    wire = original.to_wire()

    assert EngineDescriptor.from_wire(wire) == original
    assert wire["kv_layout"]["bytes_per_block"] == layout.bytes_per_block
    assert wire["transport"]["session_name"] == "127.0.0.1:15123"
    assert original.kvpool_version == __version__
    assert len(wire["regions"]) == (2 if layout.is_quantized else 1)


def test_a_sender_whose_bytes_per_block_formula_differs_is_caught() -> None:
    wire = descriptor().to_wire()
    wire["kv_layout"]["bytes_per_block"] += 2

    with pytest.raises(IncompatibleKVError, match="bytes_per_block"):
        EngineDescriptor.from_wire(wire)


def test_regions_that_do_not_hold_the_layout_are_refused() -> None:
    with pytest.raises(ValueError, match="do not hold the layout"):
        descriptor(regions=(KVRegion(0x1000, 64, 32),))


def test_an_ipv6_host_is_bracketed_in_the_session_name() -> None:
    assert descriptor(host="::1").session_name == "[::1]:15123"


def test_compatible_engines_pass() -> None:
    check_compatible(descriptor(), descriptor(engine_id="decode-0", host="10.0.0.2",
                                              rpc_port=16000))


@pytest.mark.parametrize(("field", "remote"), [
    ("model", descriptor(model="Llama")),
    ("block_size", descriptor(replace(LAYOUT, block_size=32))),
    ("kv_dtype", descriptor(replace(LAYOUT, dtype="float32"))),
    ("num_kv_heads", descriptor(replace(LAYOUT, num_kv_heads=4))),
    ("head_dim", descriptor(replace(LAYOUT, head_dim=16))),
    ("num_layers", descriptor(replace(LAYOUT, num_layers=3))),
    ("kvpool_version", descriptor(kvpool_version="0.0.1")),
])
def test_each_mismatch_is_named(field: str, remote: EngineDescriptor) -> None:
    with pytest.raises(IncompatibleKVError, match=f"{field} differs") as caught:
        check_compatible(descriptor(), remote)
    assert caught.value.field == field


def test_the_first_mismatch_is_the_one_named() -> None:
    remote = descriptor(replace(LAYOUT, block_size=32, dtype="float32", head_dim=4),
                        kvpool_version="9")

    with pytest.raises(IncompatibleKVError) as caught:
        check_compatible(descriptor(), remote)

    assert (caught.value.field, caught.value.local, caught.value.remote) == ("block_size", 16, 32)
