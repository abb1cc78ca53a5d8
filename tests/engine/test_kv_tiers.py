"""The KV tiers below the device pool, end to end on SmolLM2 (float32): swap preemption, prefix
spill to the host tier and reload, the disk tier across a restart, corrupt files and a full
disk, and tenant isolation in every tier. Every engine is checked for leaks in all tiers after
each test (`make_engine`)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvpool.engine.sampling_params import SamplingParams
from tests.engine.conftest import GREEDY, PROMPTS, fail_once, run_all, token_ids

pytestmark = pytest.mark.slow

# Every prompt but the longest (which alone needs more blocks than the pressured pool has).
PRESSURE_PROMPTS = [prompt for prompt in PROMPTS if len(prompt) < 1000]
PRESSURE = {"dtype": "float32", "num_gpu_blocks": 24, "max_num_seqs": 16}
SYSTEM = ("You are the harbour master's assistant. Answer questions about tides, moorings, "
          "berths, pilotage and the weather with care, citing the harbour rules. ") * 6


@pytest.fixture(scope="module")
def reference(smollm2) -> list[list[int]]:
    """Greedy outputs of the pressure prompts with room to spare (no preemption)."""
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.setup import build_engine_parts

    config = EngineConfig(dtype="float32")
    engine = LLMEngine(config, build_engine_parts(config, smollm2))
    outputs = token_ids(run_all(engine, PRESSURE_PROMPTS))
    assert engine.stats().num_preemptions == 0
    engine.close()
    return outputs


@pytest.mark.parametrize("options", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap", "swap_space": 0.1},
], ids=["recompute", "swap"])
def test_greedy_output_is_the_same_under_either_preemption(make_engine, reference, options):
    engine = make_engine(**PRESSURE, **options)
    outputs = token_ids(run_all(engine, PRESSURE_PROMPTS))
    stats = engine.stats()
    assert outputs == reference
    kind = options["preemption_mode"]
    assert getattr(stats, f"num_{kind}_preemptions") > 0
    assert stats.num_preemptions == getattr(stats, f"num_{kind}_preemptions")
    if kind == "swap":
        # Swapped blocks still cached on the device at resumption are retaken, not copied.
        assert 0 < stats.num_swapped_in_blocks <= stats.num_swapped_out_blocks
        assert stats.num_swapped_out_bytes == (stats.num_swapped_out_blocks
                                               * engine.kv_memory.layout.bytes_per_block)
        assert stats.num_recompute_tokens_avoided > 0
        assert stats.num_recomputed_tokens == 0


def test_a_full_host_tier_falls_back_to_recompute_in_one_run(make_engine, reference):
    """A host tier of a few blocks: some victims swap, the rest (host full) recompute."""
    engine = make_engine(**PRESSURE, preemption_mode="auto", swap_space=0.006)
    assert engine.kv_tiers.host.pool.num_blocks < 10
    assert engine.scheduler.kv.policy.rates is not None  # measured by the warm-up
    outputs = token_ids(run_all(engine, PRESSURE_PROMPTS))
    stats = engine.stats()
    assert outputs == reference
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions > 0


def test_equal_int8_outputs_under_swap_and_recompute(make_engine):
    """Quantized KV: the scales travel with the codes through the host tier."""
    runs = [make_engine(**PRESSURE, kv_cache_dtype="int8", **options) for options in
            ({"preemption_mode": "recompute"}, {"preemption_mode": "swap", "swap_space": 0.1})]
    outputs = [token_ids(run_all(engine, PRESSURE_PROMPTS)) for engine in runs]
    assert outputs[0] == outputs[1]
    assert runs[1].stats().num_swap_preemptions > 0


def test_aborting_swapped_requests_frees_their_host_blocks(make_engine):
    engine = make_engine(**PRESSURE, preemption_mode="swap", swap_space=0.1)
    ids = [engine.add_request(prompt, GREEDY).request_id for prompt in PRESSURE_PROMPTS]
    while engine.kv_tier_stats().host.num_used_blocks == 0:
        engine.step()
    for request_id in ids:
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.kv_tier_stats().host.num_used_blocks == 0


def _evict_from_device(engine, num_prompts: int = 6) -> None:
    """Fill the device pool with unrelated prompts, evicting every cached block."""
    fillers = [f"Filler {index}: " + "lorem ipsum dolor sit amet " * 30 for index in
               range(num_prompts)]
    run_all(engine, fillers)


def test_an_evicted_prefix_comes_back_from_the_host_tier(make_engine):
    engine = make_engine(dtype="float32", num_gpu_blocks=40, swap_space=0.1)
    prompt = SYSTEM + "Question: when is high tide?"
    first = run_all(engine, [prompt])[0]
    _evict_from_device(engine)
    assert engine.kv_tier_stats().num_spilled_blocks > 0
    again = run_all(engine, [prompt])[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    block_size = engine.kv_memory.layout.block_size
    num_full_blocks = (len(first.prompt_token_ids) - 1) // block_size
    assert again.num_cached_tokens == num_full_blocks * block_size
    by_tier = engine.stats().cached_tokens_by_tier
    assert first.num_cached_tokens == 0 and by_tier["host"] > 0
    assert sum(by_tier.values()) == again.num_cached_tokens  # the fillers share no prefix


def test_another_tenant_misses_in_every_tier_and_the_same_tenant_hits(make_engine, tmp_path):
    """The salt is in every key: device, host and disk."""
    options = {"dtype": "float32", "num_gpu_blocks": 40, "swap_space": 0.1,
               "kv_disk_cache": str(tmp_path)}
    engine = make_engine(**options)
    prompt = SYSTEM + "Question: where may a yacht moor?"

    def cached(engine, salt):
        request = engine.add_request(prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        return request.num_cached_tokens

    assert cached(engine, "tenant-a") == 0
    _evict_from_device(engine)
    assert cached(engine, "tenant-b") == 0  # not on the device, the host or the disk
    assert cached(engine, "tenant-a") > 0  # from the host tier
    engine.close()
    restarted = make_engine(**options)  # device and host empty: only the disk remembers
    assert cached(restarted, "tenant-b") > 0  # tenant-b's own blocks from its first request
    assert cached(restarted, "tenant-c") == 0
    assert restarted.stats().cached_tokens_by_tier["disk"] > 0


def test_a_restarted_engine_finds_the_first_ones_blocks_on_disk(make_engine, tmp_path):
    options = {"dtype": "float32", "kv_disk_cache": str(tmp_path)}
    first_engine = make_engine(**options)
    first = run_all(first_engine, [SYSTEM + "Question: who pilots the ferry?"])[0]
    first_engine.close()  # a clean shutdown: every write finished
    assert first_engine.kv_tier_stats().disk.num_files > 0
    second_engine = make_engine(**options)
    second = run_all(second_engine, [SYSTEM + "Question: who pilots the ferry?"])[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens > 0
    assert second_engine.stats().cached_tokens_by_tier == {
        "device": 0, "host": 0, "disk": second.num_cached_tokens, "shared": 0}


def test_corrupt_disk_files_are_skipped_and_counted_never_served(make_engine, tmp_path):
    options = {"dtype": "float32", "kv_disk_cache": str(tmp_path)}
    first_engine = make_engine(**options)
    prompt = SYSTEM + "Question: may I anchor in the channel?"
    first = run_all(first_engine, [prompt])[0]
    first_engine.close()
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    for index, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if index % 2:
            data = data[: len(data) // 2]  # truncated
        else:
            data[len(data) - 100] ^= 0xFF  # one flipped byte in the payload
        path.write_bytes(bytes(data))
    second_engine = make_engine(**options)
    second = run_all(second_engine, [prompt])[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens == 0
    assert second_engine.kv_tier_stats().disk.num_rejected_files == 1  # the chain stops there


def test_a_full_disk_turns_the_tier_off_with_a_warning_and_loses_nothing(
        make_engine, reference, tmpfs, caplog):
    engine = make_engine(dtype="float32", kv_disk_cache=str(tmpfs("1m")))
    with caplog.at_level(logging.WARNING, logger="kvpool.memory.tiers.disk_tier"):
        outputs = token_ids(run_all(engine, PRESSURE_PROMPTS))
        engine.close()
    disk = engine.kv_tier_stats().disk
    assert outputs == reference
    assert not disk.is_enabled and disk.num_write_errors >= 1
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disk" in warnings[0].getMessage().lower()


def _generate(engine, prompt: str, salt: str, params=GREEDY):
    request = engine.add_request(prompt, params, cache_salt=salt)
    while engine.has_unfinished_requests():
        engine.step()
    return request


def _fail_next_step(engine) -> None:
    fail_once(engine.runner, "execute", "the device fell over")
    with pytest.raises(RuntimeError, match="fell over"):
        engine.step()


def test_a_failed_step_never_writes_another_tenants_kv_under_a_prefix_hash(
        make_fast_engine, tmp_path):
    """Tenant A's prefix comes back from the host in a step that fails; tenant B's requests
    take the freed blocks in the next step. Written through after that step, B's KV would sit
    on disk under A's hashes, and a restarted engine would answer A from it."""
    bytes_per_block = make_fast_engine(dtype="float32").kv_memory.layout.bytes_per_block
    options = {"dtype": "float32", "num_gpu_blocks": 16, "swap_space": 0.01,
               "kv_disk_cache": str(tmp_path),
               # Four blocks' files: the fillers' blocks push A's out of the disk tier.
               "kv_disk_cache_size": 4 * (bytes_per_block + 1024)}
    prompt_a = "Patient record: " + "the harbour master logged tides and moorings today. " * 6
    engine = make_fast_engine(**options)
    first = _generate(engine, prompt_a, "tenant-a")
    expected = first.sequences[0].output_token_ids
    fillers = [f"Filler {index}: " + "lorem ipsum dolor sit amet " * 12 for index in range(4)]
    run_all(engine, fillers)
    disk, host = engine.kv_tiers.disk, engine.kv_tiers.host
    disk.flush()
    hashes, tokens = first.sequences[0].block_hashes[:3], first.prompt_token_ids
    chunks = [tokens[16 * index: 16 * (index + 1)] for index in range(3)]
    assert [disk.contains(block_hash) for block_hash in hashes] == [False] * 3
    assert all(host.holds(h, t) for h, t in zip(hashes, chunks, strict=True))

    again = engine.add_request(prompt_a, GREEDY, cache_salt="tenant-a")
    _fail_next_step(engine)  # A's prefix was copied up from the host, then the model failed
    assert engine.stats().cached_tokens_by_tier["host"] == 48
    engine.abort_request(again.request_id)
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    run_all(engine, [f"Tenant B note {index}:" for index in range(16)], one_token)
    disk.flush()
    for block_hash, chunk in zip(hashes, chunks, strict=True):
        stored = disk.load(block_hash, chunk)
        held = host.kv_cache.tensor[host.pool.prefix_cache.lookup(block_hash, chunk)]
        assert stored is None or torch.equal(stored.kv, held), "another tenant's KV on disk"
    engine.reset_stats()  # the host's spilled blocks go; the disk keeps its files
    engine.close()

    restarted = make_fast_engine(**options)
    assert _generate(restarted, prompt_a, "tenant-a").sequences[0].output_token_ids == expected


def test_a_failed_reload_copy_is_rolled_back_and_its_blocks_never_found(make_fast_engine):
    """The copies run before the model, inside the step's roll-back: a reload whose copy
    fails leaves no sequence with slots it never filled, no host block held, and no device
    block cached under a hash whose KV never arrived."""
    engine = make_fast_engine(dtype="float32", num_gpu_blocks=16, swap_space=0.01)
    prompt = "Patient record: " + "the harbour master logged tides and moorings today. " * 6
    expected = _generate(engine, prompt, "tenant-a").sequences[0].output_token_ids
    run_all(engine, [f"Filler {index}: " + "lorem ipsum dolor sit amet " * 12
                     for index in range(4)])
    fail_once(engine.kv_tiers.transfers, "_copy", "the copy fell over")
    request = engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
    with pytest.raises(RuntimeError, match="copy fell over"):
        engine.step()
    engine.check_invariants()
    reloaded = request.sequences[0].block_hashes[:3]  # copied up from the host: never filled
    assert not any(engine.kv_memory.pool.prefix_cache.holds(h) for h in reloaded)
    while engine.has_unfinished_requests():
        engine.step()
    assert request.sequences[0].output_token_ids == expected
