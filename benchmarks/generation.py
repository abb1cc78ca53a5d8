"""End-to-end generation, kvpool's engine and transformers `generate` on the same weights: the
parts the GPU check's `engine` and `hf` steps (`benchmarks/gpu/`) are built from.

The workload is fixed: `batch` prompts of `prompt_len` random token ids (distinct, so no prefix
hits), each generating exactly `output_len` tokens greedily (EOS ignored). Weights are the dummy
loader's (seeded), so both sides run bit-identical parameters without any file on disk.

Decode-step bound: a decode step must read every weight once (the token-embedding table only
for the batch's rows, unless tied to the LM head) plus the K/V of every context token, so
`(weight_bytes + kv_bytes_per_step) / read_bandwidth` is the fastest it can be.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from benchmarks.device_timing import synchronize


@dataclass(frozen=True, slots=True)
class Workload:
    preset: str = "llama-3-8b"
    batch: int = 64
    prompt_len: int = 512
    output_len: int = 128
    dtype: str = "bfloat16"
    seed: int = 0


def random_prompts(workload: Workload, vocab_size: int, offset: int = 0) -> list[list[int]]:
    """The workload's prompts; another `offset` gives other prompts of the same shape."""
    generator = torch.Generator().manual_seed(workload.seed + offset)
    shape = (workload.batch, workload.prompt_len)
    return torch.randint(1, vocab_size, shape, generator=generator).tolist()


def decode_bound(model_config, weight_bytes: int, workload: Workload, bandwidth: float) -> dict:
    """Bytes a mean decode step must read, and the time that takes at `bandwidth`."""
    dtype = getattr(torch, workload.dtype)
    kv_bytes_per_token = model_config.kv_layout(1, dtype).bytes_per_token
    mean_context = workload.prompt_len + workload.output_len / 2
    kv_bytes = int(workload.batch * mean_context * kv_bytes_per_token)
    return {
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_step": kv_bytes,
        "bound_ms": (weight_bytes + kv_bytes) / bandwidth * 1e3,
    }


def timed_greedy_run(engine, prompts: list[list[int]], output_len: int, device) -> dict:
    """Generate `output_len` greedy tokens (EOS ignored) for every prompt through
    `LLMEngine.step()`, timing each step: `steps` holds (seconds, number of outputs)."""
    from kvpool import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    first_id = None
    for prompt in prompts:
        request = engine.add_request({"prompt_token_ids": prompt}, params)
        first_id = first_id or request.request_id
    steps, first_tokens = [], []
    synchronize(device)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        synchronize(device)
        steps.append((time.perf_counter() - step_start, len(outputs)))
        first_tokens = next(
            (list(o.outputs[0].token_ids) for o in outputs if o.request_id == first_id),
            first_tokens,
        )
    return {"total_s": time.perf_counter() - start, "num_steps": len(steps), "steps": steps,
            "first_request_token_ids": first_tokens}


def sampled_decoding_check(llm, workload: Workload, num_prompts: int = 4) -> dict:
    """Sampled decoding on the engine's device: seeded requests with n=2, top-k/top-p, min-p
    and penalties. Passes when every token is a vocabulary id and a second run with the same
    seeds gives the same tokens."""
    from kvpool import SamplingParams

    vocab_size = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": p[:32]}
               for p in random_prompts(workload, vocab_size)[:num_prompts]]
    params = [SamplingParams(n=2, temperature=0.8, top_k=50, top_p=0.9, min_p=0.01,
                             repetition_penalty=1.1, presence_penalty=0.2, seed=index,
                             max_tokens=8, ignore_eos=True) for index in range(len(prompts))]

    def tokens() -> list[list[int]]:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [c.token_ids for o in outputs for c in o.outputs]

    first, second = tokens(), tokens()
    is_valid = all(0 <= t < vocab_size for row in first for t in row)
    return {"num_sequences": len(first), "valid_tokens": is_valid,
            "reproducible": first == second, "passed": is_valid and first == second}


def hf_llama_config(model_config):
    """The transformers `LlamaConfig` of a kvpool `ModelConfig` (plain RoPE only)."""
    from transformers import LlamaConfig

    if model_config.rope_scaling is not None or model_config.attention_bias:
        raise ValueError("the side-by-side run supports plain Llama presets only")
    return LlamaConfig(
        vocab_size=model_config.vocab_size,
        hidden_size=model_config.hidden_size,
        intermediate_size=model_config.intermediate_size,
        num_hidden_layers=model_config.num_layers,
        num_attention_heads=model_config.num_heads,
        num_key_value_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        rms_norm_eps=model_config.rms_norm_eps,
        rope_theta=model_config.rope_theta,
        max_position_embeddings=model_config.max_position_embeddings,
        tie_word_embeddings=model_config.tie_word_embeddings,
        bos_token_id=model_config.bos_token_id,
        eos_token_id=list(model_config.eos_token_ids),
        pad_token_id=0,
    )


def load_dummy_hf_model(
    preset: str, dtype: torch.dtype, seed: int, device: torch.device | str
) -> torch.nn.Module:
    """transformers' Llama holding the dummy loader's weights (checkpoint names are HF names
    without the `model.` prefix)."""
    from transformers import LlamaForCausalLM

    from kvpool.model import presets
    from kvpool.model.loaders.dummy import DummyLoader

    model_config = presets.preset(preset)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(hf_llama_config(model_config), dtype=dtype)
    parameters = dict(model.named_parameters())
    loader = DummyLoader(model_config, seed)
    with torch.no_grad():
        for name, tensor in loader.iter_weights(model_config, torch.device(device)):
            hf_name = name if name == "lm_head.weight" else f"model.{name}"
            parameters[hf_name].copy_(tensor)
    return model.eval()


def hf_generate_run(model, prompts: list[list[int]], output_len: int, device) -> dict:
    """`generate` on a batch of equal-length prompts: a prefill-only run (one token) and the
    full run, so that `decode_step_ms` = (full - prefill-only) / (output_len - 1)."""
    input_ids = torch.tensor(prompts, device=device)

    def generate(num_tokens: int) -> tuple[float, torch.Tensor]:
        synchronize(device)
        begin = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,  # EOS ignored: every sequence runs to the end
                do_sample=False,
            )
        synchronize(device)
        return time.perf_counter() - begin, output

    prefill_s, _ = generate(1)
    total_s, output = generate(output_len)
    return {
        "total_s": total_s,
        "prefill_s": prefill_s,
        "output_tok_per_s": len(prompts) * output_len / total_s,
        "decode_step_ms": (total_s - prefill_s) / max(1, output_len - 1) * 1e3,
        "first_request_token_ids": output[0, input_ids.shape[1] :].tolist(),
    }
