"""End-to-end generation benchmark: kvpool's engine and transformers `generate`, same weights.

The workload is fixed: `batch` prompts of `prompt_len` random token ids (distinct, so no prefix
hits), each generating exactly `output_len` tokens greedily (EOS ignored). Weights are the dummy
loader's (seeded), so both sides run bit-identical parameters without any file on disk.

Decode-step bound: a decode step must read every weight once (the token-embedding table only
for the batch's rows, unless tied to the LM head) plus the K/V of every context token, so
`(weight_bytes + kv_bytes_per_step) / copy_bandwidth` is the fastest it can be.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.device_timing import synchronize
from kvpool.bench.roofline import weight_bytes_read_per_step


@dataclass(frozen=True, slots=True)
class Workload:
    preset: str = "llama-3-8b"
    batch: int = 64
    prompt_len: int = 512
    output_len: int = 128
    dtype: str = "bfloat16"
    seed: int = 0


def random_prompts(workload: Workload, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(workload.seed)
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


def run_engine(
    workload: Workload, device: torch.device, attention_backend: str, bandwidth: float
) -> dict:
    """Generate through `LLMEngine.step()`, timing every step; then a short seeded, sampled
    run (temperature, top-k/top-p, penalties) on the same engine and device."""
    from kvpool import LLM

    start = time.perf_counter()
    llm = LLM(
        model=workload.preset,
        load_format="dummy",
        dtype=workload.dtype,
        device=str(device),
        attention_backend=attention_backend,
        seed=workload.seed,
        max_num_batched_tokens=4096,
        kv_cache_memory=_kv_cache_budget(device),
    )
    load_s = time.perf_counter() - start
    engine = llm.engine
    model, config = engine.runner.model, engine.model_config
    timing = _timed_greedy_run(engine, workload, device)
    # A pure decode step advances every request by one token.
    decode_steps = [s for s, n in timing.pop("steps") if n == workload.batch]
    weight_bytes = weight_bytes_read_per_step(config, model.dtype)
    bound = decode_bound(config, weight_bytes, workload, bandwidth)
    decode_ms = statistics.median(decode_steps) * 1e3 if decode_steps else None
    return {
        "workload": asdict(workload),
        "attention_backend": model.attention_backend.name,
        "load_s": load_s,
        **timing,
        "output_tok_per_s": workload.batch * workload.output_len / timing["total_s"],
        "num_decode_steps": len(decode_steps),
        "decode_step_ms": decode_ms,
        **bound,
        "decode_step_over_bound": decode_ms / bound["bound_ms"] if decode_ms else None,
        "sampled": sampled_decoding_check(llm, workload),
    }


def _timed_greedy_run(engine, workload: Workload, device: torch.device) -> dict:
    from kvpool import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
    first_id = None
    for prompt in random_prompts(workload, engine.model_config.vocab_size):
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


def _kv_cache_budget(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 28
    return 32 << 30  # 32 GiB: room for 256 sequences of 1k tokens of an 8B model


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


def load_hf_model(workload: Workload, device: torch.device) -> torch.nn.Module:
    return load_dummy_hf_model(
        workload.preset, getattr(torch, workload.dtype), workload.seed, device
    )


def load_dummy_hf_model(
    preset: str, dtype: torch.dtype, seed: int, device: torch.device | str
) -> torch.nn.Module:
    """transformers' Llama holding the dummy loader's weights (checkpoint names are HF names
    without the `model.` prefix)."""
    from transformers import LlamaForCausalLM

    from kvpool.model.config import ModelConfig
    from kvpool.model.loaders.dummy import DummyLoader

    model_config = ModelConfig.preset(preset)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(hf_llama_config(model_config), dtype=dtype)
    parameters = dict(model.named_parameters())
    loader = DummyLoader(model_config, seed)
    with torch.no_grad():
        for name, tensor in loader.iter_weights(model_config, torch.device(device)):
            hf_name = name if name == "lm_head.weight" else f"model.{name}"
            parameters[hf_name].copy_(tensor)
    return model.eval()


def run_transformers(workload: Workload, device: torch.device) -> dict:
    """The same workload through `generate`: full run, and a prefill-only run to split off
    the prefill time."""
    start = time.perf_counter()
    model = load_hf_model(workload, device)
    load_s = time.perf_counter() - start
    prompts = random_prompts(workload, model.config.vocab_size)
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

    generate(2)  # warm-up
    prefill_s, _ = generate(1)
    total_s, output = generate(workload.output_len)
    decode_ms = (total_s - prefill_s) / max(1, workload.output_len - 1) * 1e3
    return {
        "workload": asdict(workload),
        "transformers_version": __import__("transformers").__version__,
        "attn_implementation": model.config._attn_implementation,
        "load_s": load_s,
        "total_s": total_s,
        "prefill_s": prefill_s,
        "output_tok_per_s": workload.batch * workload.output_len / total_s,
        "decode_step_ms": decode_ms,
        "first_request_token_ids": output[0, workload.prompt_len :].tolist(),
    }
