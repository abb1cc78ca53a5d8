"""`kv_transfer_config` and `kv_transfer_params` as vLLM users write them: the fields kvpool
honours, vLLM's it accepts at their defaults, and a clear error naming anything else."""

from __future__ import annotations

import argparse
import json

import pytest

from kvpool.cli.args import add_engine_args, engine_config_from_args
from kvpool.engine.config import EngineConfig
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.kv_connector.config import KVTransferConfig
from kvpool.engine.kv_connector.params import RemoteDecode, RemotePrefill, parse, token_digest
from kvpool.engine.vllm_compat import engine_config

PRODUCER = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}


def test_the_two_required_fields_are_enough() -> None:
    config = KVTransferConfig.from_value(json.dumps(PRODUCER))
    assert (config.kv_ip, config.kv_port, config.kv_load_failure_policy) == (
        "127.0.0.1", 0, "recompute")
    assert config.is_producer and not config.is_consumer
    assert (config.lease_seconds, config.transfer_timeout_seconds) == (60.0, 30.0)
    assert len(config.engine_id) == 32  # a fresh uuid
    assert KVTransferConfig.from_value({**PRODUCER, "kv_role": "kv_both"}).is_consumer


def test_vllm_fields_are_taken_or_refused_by_name() -> None:
    vllm = {**PRODUCER, "engine_id": "p0", "kv_ip": "10.0.0.2", "kv_port": 14579,
            "kv_buffer_device": "cuda", "kv_buffer_size": 1e9, "kv_rank": None,
            "kv_parallel_size": 1, "kv_connector_module_path": None,
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"lease_seconds": 5, "protocol": "rdma"}}
    config = KVTransferConfig.from_value(vllm)
    assert (config.engine_id, config.kv_ip, config.kv_port) == ("p0", "10.0.0.2", 14579)
    assert config.kv_connector_extra_config["protocol"] == "rdma"
    assert config.lease_seconds == 5
    for bad, message in [
        ({"kv_role": "kv_producer"}, "kv_connector is required"),
        ({**PRODUCER, "kv_connector": "NixlConnector"}, "kv_connector must be one of"),
        ({**PRODUCER, "kv_role": "producer"}, "kv_role must be one of"),
        ({**PRODUCER, "kv_rank": 1}, "kv_rank is not supported"),
        ({**PRODUCER, "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
        ({**PRODUCER, "kv_port": 70000}, "kv_port"),
        ({**PRODUCER, "kv_connector_extra_config": {"lease_seconds": 0}}, "lease_seconds"),
        ({**PRODUCER, "kv_connector_extra_config": {"leases": 1}}, "unknown "
                                                                   "kv_connector_extra_config"),
        ({**PRODUCER, "kv_bogus": 1}, "unknown fields"),
        ("{not json", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.from_value(bad)


def test_the_flag_and_the_offline_option() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-transfer-config", json.dumps(PRODUCER)])
    assert engine_config_from_args(args).parallel.kv_transfer_config.kv_role == "kv_producer"
    offline = engine_config(None, {"kv_transfer_config": PRODUCER})  # LLM(kv_transfer_config=)
    assert offline.parallel.kv_transfer_config.kv_connector == "MooncakeConnector"


@pytest.mark.parametrize(("options", "message"), [
    ({"enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_pool": "elastic"}, "elastic"),
])
def test_engines_a_connector_cannot_serve_are_refused(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_transfer_config=PRODUCER, **options)


def test_kv_transfer_params_as_vllms_proxy_sends_them() -> None:
    assert parse(None) is None
    assert parse({"do_remote_decode": False, "do_remote_prefill": False}) is None
    assert parse({"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None}) == RemoteDecode()
    handover = RemotePrefill("p0", "127.0.0.1", 5555, "r#0", (3, 4), (1, 2), 40,
                             token_digest(range(40)))
    assert parse(handover.to_wire()) == handover
    wire = handover.to_wire()
    for bad in [[1], {"do_remote_decode": "yes"},
                {"do_remote_decode": True, "do_remote_prefill": True},
                {**wire, "remote_block_generations": [1]},
                {**wire, "remote_port": -1}, {**wire, "remote_lease_id": ""},
                {**wire, "remote_block_ids": [True, 2]}]:
        with pytest.raises(InvalidRequestError) as caught:
            parse(bad)
        assert caught.value.param == "kv_transfer_params"


def test_a_token_digest_tells_prompts_apart() -> None:
    assert token_digest([1, 2, 3]) == token_digest((1, 2, 3))
    assert token_digest([1, 2, 3]) != token_digest([1, 2, 4])
    assert token_digest([1, 2]) != token_digest([1, 2, 0])
