"""The GPU check's e2e step's parts: weights drawn on the CPU and written as a HuggingFace
directory load back as the same model, and the token comparison."""

from __future__ import annotations

from benchmarks.gpu.e2e import (
    DEVICE_VARIANTS,
    compare,
    device_variants,
    verdict,
    write_cpu_weights,
)


def test_cpu_drawn_weights_generate_as_the_dummy_loader(tmp_path):
    from kvpool import LLM, SamplingParams

    write_cpu_weights("tiny", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5]}

    def tokens(**source) -> list[int]:
        llm = LLM(**source, attention_backend="torch", kv_cache_memory=1 << 22)
        return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)

    assert tokens(model=str(tmp_path), load_format="safetensors") == tokens(
        model="tiny", load_format="dummy")


def test_compare_finds_each_prompts_first_divergence():
    comparison = compare([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert comparison == {"match_fraction": 5 / 6, "first_divergence": [None, 1],
                          "identical": False}


def test_fp32_must_be_identical_and_the_rest_close():
    exact, bf16 = DEVICE_VARIANTS[0], DEVICE_VARIANTS[2]
    close = {"match_fraction": 0.8, "identical": False}
    assert verdict(exact, close)["passed"] is False
    assert verdict(bf16, close) == {"required": "match_fraction >= 0.75", "passed": True}


def test_the_interpreter_runs_bf16_through_torch():
    names = [v.name for v in device_variants(is_interpreted=True)]
    assert "bf16_torch" in names and "bf16_triton" not in names
    assert device_variants(is_interpreted=False) == DEVICE_VARIANTS
