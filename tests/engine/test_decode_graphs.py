"""CUDA graphs for decode (`kvpool.engine.decode_graphs`).

Everything but the capture runs on any device: the padded step a graph captures is called
eagerly (`DecodeGraphRunner.eager`), with the Triton kernels in Triton's interpreter on the CPU
(`tests/attention/triton_interpreter.py`). It must give the eager runner's greedy tokens, write
KV only at the batch's slots (the null block stays zero, every other block untouched), and leave
every step that does not qualify to the eager path. The `gpu` tests capture and replay.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.attention.metadata import PAD_SLOT_ID
from kvpool.engine.config import EngineConfig
from kvpool.engine.model_runner import ModelRunner, SequenceChunk
from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.kv_cache import KVCache
from tests.attention.triton_interpreter import (
    DEVICE,
    IS_INTERPRETED,
    import_kernels_for_the_interpreter,
)
from tests.engine.conftest import run_all, token_ids

if IS_INTERPRETED:
    import_kernels_for_the_interpreter()

from kvpool.attention import triton_decode  # after the interpreter switch
from kvpool.engine.decode_graphs import DecodeGraphRunner, DecodePlan, capture_sizes, decode_plan
from kvpool.engine.decode_graphs.runner import default_capture_sizes
from kvpool.engine.setup import build_engine_parts

BLOCK_SIZE = 8
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def parts():
    """The tiny preset (2 layers, GQA 4:2, head_dim 16) in fp32 over the triton backend."""
    config = EngineConfig(model="tiny", load_format="dummy", dtype="float32", device=DEVICE,
                          attention_backend="triton", block_size=BLOCK_SIZE, num_gpu_blocks=40,
                          max_model_len=MAX_MODEL_LEN, enable_warmup=False)
    return build_engine_parts(config)


def fresh_cache(parts) -> KVCache:
    cache = parts.kv_memory.kv_cache
    return KVCache(cache.layout, cache.num_blocks, cache.tensor.device)


def plan(parts, sizes=(1, 2, 4)) -> DecodePlan:
    return DecodePlan(sizes, MAX_MODEL_LEN, parts.model_config.vocab_size)


# Three sequences: prompts of 5, 11 and 3 tokens, each with blocks for 16 more decodes.
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7, 1]]
BLOCK_IDS = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]


def prefill_chunks() -> list[SequenceChunk]:
    return [SequenceChunk(prompt, 0, blocks)
            for prompt, blocks in zip(PROMPTS, BLOCK_IDS, strict=True)]


def real_slots_mask(cache: KVCache, chunks) -> torch.Tensor:
    """[num_blocks, block_size] True at the slots the chunks' new tokens write."""
    mask = torch.zeros(cache.num_blocks, BLOCK_SIZE, dtype=torch.bool)
    layout = cache.layout
    for chunk in chunks:
        start = chunk.num_computed_tokens
        for slot in layout.slot_mapping(chunk.block_ids, start, start + len(chunk.token_ids)):
            mask[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = True
    return mask


def by_slot(cache: KVCache) -> torch.Tensor:
    """The cache as [num_blocks, block_size, ...]: one row per slot."""
    return cache.tensor.cpu().transpose(1, 3).transpose(2, 3)


def decode_side_by_side(parts, padded_plan: DecodePlan, batch_sizes: list[int]):
    """Prefill the prompts on two caches, then decode step by step with the eager runner and a
    padded one, the first `batch_sizes[i]` sequences at step i; every step checks the padded
    cache's writes. Returns both runs' greedy tokens and the padded runner."""
    model = parts.model
    eager = ModelRunner(model, fresh_cache(parts), DEVICE)
    padded = DecodeGraphRunner.eager(model, fresh_cache(parts), DEVICE, padded_plan)
    tokens = {"eager": [], "padded": []}
    chunks = prefill_chunks()
    lengths = [len(prompt) for prompt in PROMPTS]
    for step, num_seqs in enumerate([len(PROMPTS), *batch_sizes]):
        chunks = chunks[:num_seqs]
        before = by_slot(padded.kv_cache)
        logits = {name: runner.execute(chunks).sampling
                  for name, runner in (("eager", eager), ("padded", padded))}
        after = by_slot(padded.kv_cache)
        written = real_slots_mask(padded.kv_cache, chunks)
        assert torch.equal(after[~written], before[~written]), "a write outside the batch's slots"
        assert not after[NULL_BLOCK_ID].any(), "the null block must stay zero"
        torch.testing.assert_close(after[written], by_slot(eager.kv_cache)[written])
        size = padded_plan.batch_size_for(num_seqs) if step else None  # step 0: the prefill
        if size is not None:  # the padding rows, as padded_decode's table says
            buffers = padded.padded
            assert not buffers.block_tables[0][num_seqs:size].any()
            assert buffers.seq_lens[num_seqs:size].eq(1).all()
            assert buffers.slot_mappings[0][num_seqs:size].eq(PAD_SLOT_ID).all()
        for name, rows in logits.items():
            tokens[name].append(rows.argmax(dim=-1).tolist())
        next_ids = tokens["eager"][-1]
        chunks = [SequenceChunk([token], lengths[i], BLOCK_IDS[i])
                  for i, token in enumerate(next_ids)]
        lengths = [length + 1 for length in lengths[:num_seqs]]
    return tokens["eager"], tokens["padded"], padded


@pytest.mark.parametrize("num_sms", [1, 64], ids=["one-split", "planned-splits"])
def test_padded_decode_gives_the_eager_runners_tokens(parts, num_sms, monkeypatch):
    # 64 multiprocessors make the plan split the context (planned for max_model_len) where the
    # eager step does not: the padded step's splits are the plan's, and the tokens agree.
    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: num_sms)
    # 3 decodes padded to 4, then 2 padded to 4 (row 2 held a sequence, now padding), then 1.
    batch_sizes = [3, 3, 2, 2, 1]
    eager_tokens, padded_tokens, runner = decode_side_by_side(parts, plan(parts, (1, 4)),
                                                              batch_sizes)
    assert padded_tokens == eager_tokens
    assert runner.num_padded_steps == len(batch_sizes)  # the prefill step ran eagerly


def test_a_batch_above_the_largest_size_runs_eagerly(parts):
    eager_tokens, padded_tokens, runner = decode_side_by_side(parts, plan(parts, (1, 2)),
                                                              [3, 3, 2, 1])
    assert padded_tokens == eager_tokens
    assert runner.num_padded_steps == 2  # the steps of 2 and 1 sequences


@pytest.mark.parametrize(("chunks", "is_pure_decode"), [
    ([SequenceChunk([7], 4, [1]), SequenceChunk([8], 2, [2])], True),
    ([SequenceChunk([7], 4, [1]), SequenceChunk([8, 9], 2, [2])], False),  # an extend
    ([SequenceChunk([7], 4, [1], num_samples=0)], False),  # a one-token prompt chunk
    ([SequenceChunk([7], 4, [1], num_samples=2)], False),  # sampled twice (forked)
    ([SequenceChunk([7], 4, [1], prompt_logprob_positions=range(4, 5))], False),
])
def test_only_decode_only_steps_qualify(parts, chunks, is_pure_decode):
    runner = DecodeGraphRunner.eager(parts.model, fresh_cache(parts), DEVICE, plan(parts))
    assert runner.prepare(chunks).is_pure_decode is is_pure_decode
    eager = ModelRunner(parts.model, fresh_cache(parts), DEVICE)
    expected = eager.execute(chunks)
    actual = runner.execute(chunks)
    assert runner.num_padded_steps == int(is_pure_decode)
    torch.testing.assert_close(actual.sampling, expected.sampling)
    torch.testing.assert_close(actual.prompt, expected.prompt)


def test_engine_with_padded_decode_generates_the_eager_engines_tokens(parts):
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling_params import SamplingParams

    def generate(padded: bool) -> tuple[list[list[int]], LLMEngine]:
        # enforce_eager: on CUDA too, the engine starts with the eager runner.
        config = EngineConfig(model="tiny", load_format="dummy", dtype="float32", device=DEVICE,
                              attention_backend="triton", block_size=BLOCK_SIZE,
                              num_gpu_blocks=40, max_model_len=MAX_MODEL_LEN,
                              enable_warmup=False, max_num_seqs=4, enforce_eager=True)
        engine = LLMEngine(config, build_engine_parts(config))
        if padded:
            engine.runner = DecodeGraphRunner.eager(engine.parts.model, engine.kv_memory.kv_cache,
                                                    DEVICE, plan(engine.parts, (2, 4)))
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        return token_ids(run_all(engine, PROMPTS, params)), engine

    expected, _ = generate(padded=False)
    actual, engine = generate(padded=True)
    assert actual == expected
    assert engine.runner.num_padded_steps > 0


def generate_hybrid(checkpoint, runner: str | None) -> tuple[list[list[int]], object]:
    """Greedy tokens of a Gemma-3-style checkpoint with the hybrid manager on, on the triton
    backend, with the eager runner (None) or a padded one run "eager" or "captured"."""
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.sampling_params import SamplingParams
    from kvpool.memory.hybrid_memory import HybridKVMemory

    config = EngineConfig(model=str(checkpoint), dtype="float32", device=DEVICE,
                          attention_backend="triton", block_size=4, num_gpu_blocks=60,
                          max_model_len=128, enable_warmup=False, max_num_seqs=4,
                          enforce_eager=True)
    engine = LLMEngine(config, build_engine_parts(config))
    assert isinstance(engine.kv_memory, HybridKVMemory)
    if runner is not None:
        make = DecodeGraphRunner.eager if runner == "eager" else DecodeGraphRunner.capture
        engine.runner = make(engine.parts.model, engine.kv_memory.kv_cache, DEVICE,
                             DecodePlan((2, 4), 128, engine.parts.model_config.vocab_size))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return token_ids(run_all(engine, [[*prompt, *prompt] for prompt in PROMPTS], params)), engine


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    from tests.model.test_architectures import save_tiny

    directory = tmp_path_factory.mktemp("gemma3_graphs")
    save_tiny(directory, "gemma3_text")  # window 8: a decode drops blocks as it goes
    return directory


def test_padded_decode_serves_a_hybrid_pools_groups(gemma3_checkpoint):
    """The hybrid manager on: each KV cache group's slot mapping and block tables padded
    apart; the engine's tokens equal the eager engine's, the windows' dropped blocks null in
    their tables."""
    expected, _ = generate_hybrid(gemma3_checkpoint, None)
    actual, engine = generate_hybrid(gemma3_checkpoint, "eager")
    assert actual == expected
    assert engine.runner.num_padded_steps > 0
    assert len(engine.runner.padded.block_tables) == len(engine.kv_memory.groups) == 2


# ---------------------------------------------------------------- which engines capture
def test_default_capture_sizes_follow_vllms_pattern():
    assert default_capture_sizes(4) == (1, 2, 4)
    assert default_capture_sizes(5) == (1, 2, 4, 5)
    assert default_capture_sizes(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    sizes = default_capture_sizes(512)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-3:] == (480, 496, 512) and 264 not in sizes


@pytest.mark.parametrize(("options", "expected"), [
    ({}, default_capture_sizes(256)),  # max_num_seqs 256
    ({"max_num_seqs": 1024}, default_capture_sizes(512)),
    ({"max_cudagraph_capture_size": 24}, (1, 2, 4, 8, 16, 24)),
    ({"cudagraph_capture_sizes": [8, 1, 300], "max_num_seqs": 256}, (1, 8)),
])
def test_capture_sizes(options, expected):
    assert capture_sizes(EngineConfig(**options)) == expected


@pytest.mark.parametrize(("options", "device", "captures"), [
    ({}, "cuda", True),
    ({"enforce_eager": True}, "cuda", False),
    ({}, "cpu", False),
    ({"cudagraph_capture_sizes": [512], "max_num_seqs": 8}, "cuda", False),  # none fits
])
def test_decode_plan_only_where_graphs_apply(parts, options, device, captures):
    config = EngineConfig(**options)
    plan_ = decode_plan(config, parts.model, torch.device(device), 2048, 512)
    assert (plan_ is not None) is captures
    assert plan_ is None or plan_.max_seq_len == 2048


def test_no_decode_plan_for_another_attention_backend(parts):
    class TorchBackendModel(torch.nn.Module):
        attention_backend = type("Backend", (), {"name": "torch"})()

    assert decode_plan(EngineConfig(), TorchBackendModel(), torch.device("cuda"), 64, 8) is None


def test_plan_picks_the_smallest_size_that_holds_the_batch():
    sizes = DecodePlan((1, 2, 4, 8), 64, 8)
    assert [sizes.batch_size_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError, match="ascending"):
        DecodePlan((2, 1), 64, 8)


# ---------------------------------------------------------------- GPU: capture and replay
NO_CUDA = "needs a CUDA device"


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(IS_INTERPRETED, reason=NO_CUDA)(test))


@gpu
def test_gpu_replay_equals_the_eager_padded_step(parts):
    # The same kernels on the same inputs: a replay's logits equal the eager call's, bit for
    # bit, and its KV writes too; sizes 4, 1, 2 serve batches of 3, 1 and 2.
    captured = DecodeGraphRunner.capture(parts.model, fresh_cache(parts), DEVICE, plan(parts))
    eager = DecodeGraphRunner.eager(parts.model, fresh_cache(parts), DEVICE, plan(parts))
    prefill = prefill_chunks()
    captured.execute(prefill)
    eager.execute(prefill)
    lengths = [len(prompt) for prompt in PROMPTS]
    for step, num_seqs in enumerate([3, 1, 2, 3]):
        chunks = [SequenceChunk([step + i + 1], lengths[i], BLOCK_IDS[i])
                  for i in range(num_seqs)]
        assert torch.equal(captured.execute(chunks).sampling, eager.execute(chunks).sampling)
        lengths[:num_seqs] = [length + 1 for length in lengths[:num_seqs]]
    assert captured.num_padded_steps == 4
    assert torch.equal(captured.kv_cache.tensor, eager.kv_cache.tensor)
    assert not captured.kv_cache.tensor[NULL_BLOCK_ID].any()


def gpu_greedy_tokens(**options) -> tuple[list[list[int]], object]:
    from kvpool import LLM, SamplingParams

    llm = LLM(model="smollm2-135m", load_format="dummy", dtype="float32", device="cuda",
              attention_backend="triton", kv_cache_memory=1 << 28, max_model_len=2048,
              max_num_seqs=8, **options)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for i in range(5 + 40 * j)]}
               for j in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs], llm.engine.runner


@gpu
def test_gpu_graphed_greedy_generation_equals_enforce_eager():
    # Dummy SmolLM2-shaped weights (GQA 9:3, head_dim 64) in fp32; six sequences decode as a
    # batch of 6 padded to 8, then fewer as they finish (all at once here: same max_tokens).
    expected, eager_runner = gpu_greedy_tokens(enforce_eager=True)
    assert type(eager_runner) is ModelRunner
    actual, runner = gpu_greedy_tokens()
    assert isinstance(runner, DecodeGraphRunner) and runner.num_padded_steps > 0
    assert runner.padded.plan.batch_sizes == (1, 2, 4, 8)
    assert actual == expected


@gpu
def test_gpu_replay_serves_a_hybrid_pools_groups(gemma3_checkpoint):
    """Captured graphs over a hybrid pool's group views give the eager engine's tokens."""
    expected, _ = generate_hybrid(gemma3_checkpoint, None)
    actual, engine = generate_hybrid(gemma3_checkpoint, "captured")
    assert actual == expected and engine.runner.num_padded_steps > 0
