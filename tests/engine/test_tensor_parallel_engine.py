"""The engine at tensor_parallel_size=2 (CPU, gloo, one spawned worker) against tp=1.

A tiny random Llama saved as a safetensors checkpoint (4 heads, 2 KV heads: tp=2 splits
both) so both engines load the same weights, rank r reading its slices; fp32, greedy, so
outputs must be token-identical. One tp=2 engine (a small pool, small chunks: prefill is
chunked, sequences are preempted and recomputed, prefixes are cached) serves the equivalence
tests and is closed by its last test; the start-up, fault and 8B tests build their own first,
and the speculative-decoding test its own after.
Only one tensor-parallel engine lives in a process at a time (the default process group is
process-global), so the order of this file matters.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import socket
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.parallel import WorkerError, group
from kvpool.engine.sampling_params import SamplingParams
from kvpool.model import presets
from tests.model.hf_checkpoint import save_hf_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
# A small pool and small chunks: chunked prefill, preemption (recompute), prefix caching.
OPTIONS = {"load_format": "safetensors", "dtype": "float32", "block_size": 4,
           "num_gpu_blocks": 40, "max_num_batched_tokens": 24,
           "preemption_mode": "recompute", "enable_warmup": False}
# Where nothing is meant to fail, a collective may wait this long: on a busy 2-core machine the
# two ranks load and step at different speeds (the dummy 8B shape took 250 s to start with two
# CPU-bound processes beside it), and a slow rank must slow the test, never fail it. The fault
# tests keep short timeouts: what they measure is the bound.
PATIENT = {"distributed_timeout_seconds": 600}


def _prompts() -> list[list[int]]:
    """Twelve token-id prompts of 1 to ~100 tokens, some sharing a prefix."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [[rng.randrange(3, 512) for _ in range(length)]
               for length in (1, 3, 7, 15, 30, 60, 100, 5)]
    return [*prompts, [*shared, 9, 10], [*shared, 11], shared[:20], shared * 2]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(save_hf_checkpoint(tmp_path_factory.mktemp("tp_engine") / "tiny",
                                  presets.preset("tiny")))


def run_all(engine: LLMEngine, prompts: list[list[int]],
            params: SamplingParams = GREEDY) -> list[list[list[int]]]:
    """Every prompt to completion; each request's completions' token ids, in order."""
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [[list(seq.output_token_ids) for seq in request.sequences] for request in requests]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ------------------------------------------------------------ before any engine
def test_a_free_port_stays_reserved_until_rank_0_listens_on_it():
    # No other process can take the store's port between choosing it and listening on it.
    port = group.free_port()
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    finally:
        group._reserved_listeners.pop(port).close()


def test_shapes_tp_cannot_split_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="num_heads"):
        LLMEngine(EngineConfig(tensor_parallel_size=4))  # SmolLM2: 9 heads
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(("options", "named"), [
    ({"swap_space": 1.0}, "swap_space"),
    ({"kv_disk_cache": "/tmp/kv"}, "kv_disk_cache"),
    ({"kv_pool": "elastic"}, "kv_pool='elastic'"),
    ({"device": "mps"}, "device='mps'"),
])
def test_unsupported_options_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=f"does not support {named}"):
        EngineConfig(tensor_parallel_size=2, **options)


def test_ranks_never_share_a_gpu(monkeypatch):
    group.check_gpu_count(2, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    named = r"2 rank\(s\), 1 GPU\(s\) visible \(CUDA_VISIBLE_DEVICES='3'\)"
    with pytest.raises(ValueError, match=named):
        group.check_gpu_count(2, 1)
    # A rank's own GPU is its local rank's, never wrapped round onto another rank's.
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(ValueError, match="one GPU per rank"):
        group.rank_device(torch.device("cuda"), 0)
    assert group.rank_device(torch.device("cpu"), 5) == torch.device("cpu")


def test_a_preloaded_model_is_refused(checkpoint):
    from kvpool.engine.setup import build_engine_parts, load_engine_model

    loaded = load_engine_model(EngineConfig(model=checkpoint, **OPTIONS))
    with pytest.raises(ValueError, match="one shard per rank"):
        build_engine_parts(EngineConfig(model=checkpoint, tensor_parallel_size=2, **OPTIONS),
                           loaded)


# ------------------------------------------------------------ faults
def test_a_killed_worker_fails_the_step_in_bounded_time(checkpoint):
    engine = LLMEngine(EngineConfig(model=checkpoint, tensor_parallel_size=2,
                                    distributed_timeout_seconds=10, **OPTIONS))
    try:
        [pid] = engine.workers.pids
        for prompt in PROMPTS[:4]:
            engine.add_request(prompt, GREEDY)
        engine.step()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) was killed by "
                                              r"signal 9 \(SIGKILL\)"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 30
        assert "worker rank 1" in engine.unhealthy_reason
        start = time.monotonic()
        with pytest.raises(WorkerError, match="group broken"):
            engine.step()
        assert time.monotonic() - start < 5  # a broken group fails at once, without waiting
    finally:
        engine.close()
    assert_gone([pid])


def test_a_hung_worker_fails_the_step_after_the_timeout(checkpoint):
    # 10 s, not less: the worker must still take its first steps in time on a busy machine.
    engine = LLMEngine(EngineConfig(model=checkpoint, tensor_parallel_size=2,
                                    distributed_timeout_seconds=10, **OPTIONS))
    [pid] = engine.workers.pids
    try:
        engine.add_request(PROMPTS[0], GREEDY)
        engine.step()
        os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing: a hang, not a death
        start = time.monotonic()
        with pytest.raises(WorkerError):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 30  # the 10 s timeout, not forever
        assert engine.unhealthy_reason is not None
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close()
    assert_gone([pid])


# ------------------------------------------------------------ the 8B shape
@pytest.mark.usefixtures("memory_heavy")
def test_the_dummy_8b_shape_starts_at_tp2_and_steps():
    # Every matrix of Llama-3-8B's shape, split over two ranks; two of its 32 layers, so that
    # the two ranks hold 3 GiB rather than 16 (beside the suite's other worker, on 24 GiB).
    eight_b = presets.preset("llama-3-8b").replace(num_layers=2)
    engine = LLMEngine(EngineConfig(model=eight_b, load_format="dummy", dtype="bfloat16",
                                    tensor_parallel_size=2, num_gpu_blocks=4,
                                    max_model_len=32, enable_warmup=False, **PATIENT))
    try:
        assert engine.kv_memory.layout.num_kv_heads == 4  # 8 KV heads over 2 ranks
        engine.add_request([128000, 791, 6864], SamplingParams(max_tokens=1))
        outputs = engine.step()
        assert len(outputs[0].outputs[0].token_ids) == 1
    finally:
        engine.close()


# ------------------------------------------------------------ tp=2 == tp=1
@pytest.fixture(scope="module")
def engines(checkpoint) -> dict[int, LLMEngine]:
    # tp=2 all-reduces in two overlapped pieces: the same tokens prove the overlap exact (the
    # whole-tensor all-reduce is the model tests' and the tp benchmark test's).
    built = {size: LLMEngine(EngineConfig(model=checkpoint, tensor_parallel_size=size,
                                          tensor_parallel_overlap_chunks=size, **PATIENT,
                                          **OPTIONS))
             for size in (1, 2)}
    yield built
    for engine in built.values():
        engine.close()


def test_greedy_outputs_equal_tp1_with_chunks_and_preemption(engines):
    outputs = {size: run_all(engine, PROMPTS) for size, engine in engines.items()}
    assert outputs[2] == outputs[1]
    assert engines[2].scheduler.num_preemptions > 0  # the small pool did preempt
    assert engines[2].kv_memory.layout.num_kv_heads == 1  # each rank: 1 of the 2 KV heads
    assert engines[2].memory_stats().num_used_blocks == 0


def test_a_repeated_prompt_hits_the_prefix_cache_and_still_matches(engines):
    long_prompt = PROMPTS[6]  # 100 tokens: 25 of the 40 blocks
    first = run_all(engines[2], [long_prompt])
    before = engines[2].memory_stats().prefix_cache_hits_tokens
    again = run_all(engines[2], [long_prompt])  # after it finished: its blocks are cached
    assert engines[2].memory_stats().prefix_cache_hits_tokens >= before + 96
    assert first == again == run_all(engines[1], [long_prompt])


def test_seeded_sampling_with_n2_equals_tp1(engines):
    # Rank 0 samples from logits equal to rounding, with the same seeds.
    outputs = {size: run_all(engine, PROMPTS[:6], SEEDED) for size, engine in engines.items()}
    assert outputs[2] == outputs[1]
    assert all(len(completions) == 2 for completions in outputs[2])


def test_close_leaves_no_worker_alive(engines):
    pids = engines[2].workers.pids
    engines[2].close()
    engines[2].close()  # idempotent
    assert_gone(pids)
    assert multiprocessing.active_children() == []


# ------------------------------------------------------------ tp=2 with drafts
@pytest.fixture(scope="module")
def bigram_checkpoint(tmp_path_factory) -> str:
    """The tiny checkpoint with its layers' outputs scaled down: each token's logits then lean
    on the token itself, so greedy answers revisit earlier n-grams and some drafts are right
    (the full-strength random model's never are)."""
    path = save_hf_checkpoint(tmp_path_factory.mktemp("tp_spec") / "tiny",
                              presets.preset("tiny"))
    weights = load_file(str(path / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = tensor * 0.1
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def test_speculative_drafts_at_tp2_give_tp1s_tokens(bigram_checkpoint):
    # The workers run the step the runner prepared, drafted rows included: tp=2 with prompt
    # lookup must give tp=1's tokens without it.
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    reference = LLMEngine(EngineConfig(model=bigram_checkpoint, **OPTIONS))
    expected = run_all(reference, PROMPTS, params)
    reference.close()
    engine = LLMEngine(EngineConfig(model=bigram_checkpoint, tensor_parallel_size=2,
                                    speculative_config=speculative, **PATIENT, **OPTIONS))
    try:
        assert run_all(engine, PROMPTS, params) == expected
        spec = engine.stats().spec_decode
        assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
        assert engine.memory_stats().num_used_blocks == 0
    finally:
        engine.close()
