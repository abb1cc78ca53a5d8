"""The whole engine on architectures other than Llama: a Gemma 3 (sliding-window layers, two
RoPE bases, Gemma's norms) and a Qwen3-MoE (experts beside a dense layer), both tiny with
random weights and SmolLM2's vocabulary and tokenizer, so that chat templates, structured
outputs and the server run for real. Prefix caching with chunked prefill, both kinds of
preemption, int8/fp8 KV, structured outputs, the server and `kvpool inspect`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts
from kvpool.engine.structured_outputs import StructuredOutputsParams
from kvpool.model.hf_config import config_from_hf
from kvpool.model.loaders.auto import load_model
from kvpool.model.loaders.base import LoadedModel
from tests.engine.conftest import run_all, token_ids

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)


def tiny_config(kind: str, vocab_size: int):
    import transformers

    if kind == "gemma3_text":  # windows of 16 tokens, shorter than the prompts
        return transformers.Gemma3TextConfig(**SHAPE, vocab_size=vocab_size, num_hidden_layers=6,
                                             sliding_window=16, query_pre_attn_scalar=16)
    return transformers.Qwen3MoeConfig(**SHAPE, vocab_size=vocab_size, num_hidden_layers=2,
                                       moe_intermediate_size=32, num_experts=8,
                                       num_experts_per_tok=2, norm_topk_prob=True,
                                       mlp_only_layers=[1])


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_moe"])
def model(request, smollm2) -> LoadedModel:
    """Random weights of the architecture, with SmolLM2's vocabulary, stop tokens and
    tokenizer (its chat template too)."""
    config = dataclasses.replace(
        config_from_hf(tiny_config(request.param, smollm2.config.vocab_size).to_dict()),
        eos_token_ids=smollm2.config.eos_token_ids, bos_token_id=smollm2.config.bos_token_id)
    dummy = load_model(config, load_format="dummy", seed=1)
    return LoadedModel(config, dummy.model, smollm2.tokenizer, dummy.load_seconds)


def engine_over(model: LoadedModel, **options) -> LLMEngine:
    config = EngineConfig(**{"dtype": "float32", "enable_warmup": False, **options})
    return LLMEngine(config, build_engine_parts(config, model))


def prompts(model: LoadedModel) -> list[list[int]]:
    """Prompts longer than the window, two sharing a 40-token prefix."""
    generator = torch.Generator().manual_seed(4)
    vocab = model.config.vocab_size
    shared = torch.randint(0, vocab, (40,), generator=generator).tolist()
    rest = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 30, 70)]
    return [shared + rest[0], shared + rest[1], rest[2], rest[0]]


def test_prefix_caching_and_chunked_prefill_change_no_token(model):
    alone = [token_ids(run_all(engine_over(model, enable_prefix_caching=False), [p], GREEDY))[0]
             for p in prompts(model)]
    engine = engine_over(model, max_num_batched_tokens=24, block_size=8)
    together = token_ids(run_all(engine, prompts(model), GREEDY))
    assert together == alone
    assert engine.stats().cached_tokens_by_tier["device"] >= 40 - 8


@pytest.mark.parametrize("options", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap", "swap_space": 0.05},
], ids=["recompute", "swap"])
def test_preemption_changes_no_token(model, options):
    expected = token_ids(run_all(engine_over(model), prompts(model), GREEDY))
    engine = engine_over(model, block_size=8, num_gpu_blocks=16, max_num_seqs=4, **options)
    assert token_ids(run_all(engine, prompts(model), GREEDY)) == expected
    assert engine.stats().num_preemptions > 0


# Per-row scales; int8 keeps 8 bits of each value, fp8 e4m3 only 4 (a 1/16 relative step).
MAX_LOGPROB_ERROR = {"int8": 0.1, "fp8": 0.5}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_keeps_prompt_logprobs_close(model, kv_cache_dtype):
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs(engine) -> torch.Tensor:
        output = run_all(engine, prompts(model)[1:2], params)[0]
        prompt = output.prompt_token_ids
        return torch.tensor([entry[token].logprob
                             for entry, token in zip(output.prompt_logprobs[1:], prompt[1:],
                                                     strict=True)])

    exact = logprobs(engine_over(model))
    quantized = logprobs(engine_over(model, kv_cache_dtype=kv_cache_dtype))
    error = (quantized - exact).abs()
    assert error.max() < MAX_LOGPROB_ERROR[kv_cache_dtype] and error.mean() < 0.1


def test_structured_outputs_hold(model):
    engine = engine_over(model)
    choices = ["yes please", "no thanks", "maybe later"]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outputs = run_all(engine, ["Shall we?", "Again?", "Once more?"], params)
    assert all(output.outputs[0].text in choices for output in outputs)


def test_the_server_chats_and_inspect_reads_its_snapshot(model, capsys):
    from kvpool.cli import main
    from tests.server.conftest import serve

    with serve(model, num_gpu_blocks=64, dtype="float32") as server:
        reply = server.client().chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hello!"}],
            max_completion_tokens=8, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
        server.wait_until_idle()
        assert main(["inspect", "--url", server.base_url]) == 0
    summary = capsys.readouterr().out
    assert "blocks" in summary
