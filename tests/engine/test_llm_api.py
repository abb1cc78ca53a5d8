"""The offline API as a vLLM script calls it: vLLM's arguments at neutral values accepted with
one warning (others refused, unknown ones a TypeError with a suggestion), dtype "auto", token-id
prompts, Hub ids from the local cache, the transformers tokenizer, and the model's
generation_config.json as the default sampling params.

Most tests run a tiny random Llama saved as a HuggingFace directory (it loads in well under a
second); the tokenizer test uses the shared SmolLM2 engine.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from kvpool import LLM, SamplingParams
from kvpool.engine.config import EngineConfig
from kvpool.engine.vllm_compat import ENGINE_CONFIG_FIELDS, RENAMED, VLLM_ARGS
from tests.model.test_loaders import make_hub_cache, save_tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=6)
SMALL = {"dtype": "float32", "kv_cache_memory": 4 << 20, "enable_warmup": False}
GENERATION_CONFIG = {"temperature": 0.0, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.05,
                     "max_new_tokens": 5, "do_sample": True, "eos_token_id": 2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama as an HF directory, without tokenizer or generation config."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(directory)
    (directory / "generation_config.json").unlink()
    return directory


def _with_generation_config(source: Path, target: Path, content: dict) -> Path:
    shutil.copytree(source, target)
    (target / "generation_config.json").write_text(json.dumps(content))
    return target


def _token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params,
                                                                    use_tqdm=False)]


# ------------------------------------------------------------------ vLLM's arguments
def test_vllm_arguments_at_neutral_values_are_ignored_with_one_warning(tiny_dir, caplog):
    neutral = {
        "pipeline_parallel_size": 1,
        "trust_remote_code": True, "disable_log_stats": True, "max_logprobs": 5,
        "tokenizer": str(tiny_dir), "tokenizer_mode": "auto", "revision": None,
        "download_dir": None, "disable_custom_all_reduce": True,
        "compilation_config": {"level": 3}, "seed": 0,
    }
    with caplog.at_level(logging.WARNING, logger="kvpool.engine.vllm_compat"):
        llm = LLM(str(tiny_dir), **SMALL, **neutral)
    warnings = [r for r in caplog.records if r.name == "kvpool.engine.vllm_compat"]
    assert len(warnings) == 1
    assert all(f"{name}=" in warnings[0].getMessage() for name in neutral if name != "seed")
    assert _token_ids(llm, [[5, 6, 7]]) == _token_ids(LLM(str(tiny_dir), **SMALL), [[5, 6, 7]])


def test_vllm_names_of_kvpool_options_are_renamed(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", enable_warmup=False,
              kv_cache_memory_bytes=2 << 20, num_gpu_blocks_override=9)
    cache = llm.engine.config.cache
    assert (cache.kv_cache_memory, cache.num_gpu_blocks) == (2 << 20, 9)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes is vLLM's name for "
                                         "kv_cache_memory: give one of them"):
        LLM(str(tiny_dir), kv_cache_memory_bytes=1 << 20, kv_cache_memory=1 << 20)


@pytest.mark.parametrize(("options", "message"), [
    ({"pipeline_parallel_size": 2}, "kvpool splits a model only by tensor parallelism "
                                    r"\(tensor_parallel_size\); pipeline_parallel_size must be 1"),
    ({"pipeline_parallel_size": True}, "pipeline_parallel_size must be 1"),  # a bool is no size
    ({"tokenizer": "other/tokenizer"}, "tokenizer must be None or the model"),
    ({"quantization": "awq"}, r"quantization must be one of \('gguf', 'int8', 'int4', "
                              r"'none'\) or None"),
    ({"revision": "v2"}, "pass its snapshot directory as the model"),
    ({"download_dir": "/models"}, "set HF_HUB_CACHE"),
    ({"enable_lora": True}, "kvpool has no LoRA adapters"),
    ({"disable_sliding_window": True}, "kvpool runs the window; max_model_len caps"),
])
def test_a_vllm_argument_kvpool_cannot_honour_is_refused_before_loading(options, message):
    with pytest.raises(ValueError, match=message):
        LLM("no/such-model-is-loaded", **options)


def test_all_refused_arguments_are_named_at_once():
    with pytest.raises(ValueError, match=r"arguments: pipeline_parallel_size=2: .*; "
                                         r"cpu_offload_gb=4: .*must be 0"):
        LLM(pipeline_parallel_size=2, cpu_offload_gb=4)


@pytest.mark.parametrize(("name", "suggestion"), [
    ("tensor_paralel_size", "tensor_parallel_size"),
    ("max_num_seq", "max_num_seqs"),
    ("enable_prefix_cache", "enable_prefix_caching"),
])
def test_an_unknown_keyword_is_a_type_error_with_the_closest_name(name, suggestion):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'; did you mean "
                                        f"'{suggestion}'"):
        LLM(**{name: 1})
    with pytest.raises(TypeError, match=r"'frobnicate'$"):
        LLM(frobnicate=1)


def test_the_compat_table_holds_only_arguments_kvpool_lacks():
    names = [arg.name for arg in VLLM_ARGS]
    assert len(names) == len(set(names))
    assert not set(names) & ENGINE_CONFIG_FIELDS and not set(names) & RENAMED.keys()
    assert set(RENAMED.values()) <= ENGINE_CONFIG_FIELDS
    for arg in VLLM_ARGS:
        assert arg.reason, arg.name
        assert arg.neutral is None or arg.name in arg.supported, arg.name  # names itself


# ------------------------------------------------------------- dtype, prompts, tokenizer
def test_dtype_auto_is_accepted(tiny_dir):
    assert EngineConfig(dtype="auto").load.dtype == "auto"
    llm = LLM(str(tiny_dir), dtype="auto", kv_cache_memory=4 << 20, enable_warmup=False)
    assert str(llm.engine.dtype) in ("torch.bfloat16", "torch.float32")


def test_a_list_of_ints_is_one_prompt_and_a_list_of_lists_many(tiny_dir):
    llm = LLM(str(tiny_dir), **SMALL)
    [one] = llm.generate([5, 6, 7], GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == [5, 6, 7]
    [first, second] = llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    assert (first.prompt_token_ids, second.prompt_token_ids) == ([5, 6, 7], [8, 9])
    assert first.outputs[0].token_ids == one.outputs[0].token_ids
    [as_dict] = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert as_dict.outputs[0].token_ids == one.outputs[0].token_ids
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_get_tokenizer_is_the_transformers_tokenizer(make_engine):
    from transformers import PreTrainedTokenizerBase

    llm = LLM.from_engine(make_engine(kv_cache_memory=16 << 20, enable_warmup=False))
    tokenizer = llm.get_tokenizer()
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    assert tokenizer is llm.engine.tokenizer.hf_tokenizer
    assert tokenizer.encode("Hello there") == llm.engine.tokenizer.encode("Hello there")


def test_a_model_without_a_tokenizer_has_none(tiny_dir):
    assert LLM(str(tiny_dir), **SMALL).get_tokenizer() is None


# ------------------------------------------------------------------------ Hub ids
def test_a_hub_id_loads_from_the_local_cache_like_its_path(tiny_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache_dir = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    snapshot = make_hub_cache(cache_dir, "org/tiny-llama")
    shutil.copytree(tiny_dir, snapshot, dirs_exist_ok=True)
    by_id = LLM("org/tiny-llama", tokenizer="org/tiny-llama", **SMALL)
    prompts = [[5, 6, 7], list(range(10, 40))]
    assert _token_ids(by_id, prompts) == _token_ids(LLM(str(snapshot), **SMALL), prompts)
    with pytest.raises(ValueError, match="`hf download org/absent`"):
        LLM("org/absent", **SMALL)


# ------------------------------------------------------------- generation config
def test_the_models_generation_config_is_the_default_sampling_params(tiny_dir, tmp_path):
    model = _with_generation_config(tiny_dir, tmp_path / "model", GENERATION_CONFIG)
    llm = LLM(str(model), **SMALL)
    expected = {"temperature": 0.0, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.05,
                "max_tokens": 5}
    assert llm.engine.default_sampling_params() == expected
    assert llm.get_default_sampling_params() == SamplingParams(**expected)
    explicit = SamplingParams(**expected)
    assert _token_ids(llm, [[5, 6, 7]], None) == _token_ids(llm, [[5, 6, 7]], explicit)
    assert len(_token_ids(llm, [[5, 6, 7]], None)[0]) == 5  # not SamplingParams' 16


def test_generation_config_vllm_ignores_the_model_and_overrides_merge(tiny_dir, tmp_path):
    model = str(_with_generation_config(tiny_dir, tmp_path / "model", GENERATION_CONFIG))
    ignored = LLM(model, generation_config="vllm", **SMALL)
    assert ignored.engine.default_sampling_params() == {}
    assert ignored.get_default_sampling_params() == SamplingParams()
    merged = LLM(model, override_generation_config={"temperature": 0.5, "max_new_tokens": 3},
                 **SMALL)
    assert merged.engine.default_sampling_params() == {
        "temperature": 0.5, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.05,
        "max_tokens": 3}
    only = LLM(str(tiny_dir), generation_config="vllm",
               override_generation_config={"top_p": 0.5}, **SMALL)
    assert only.engine.default_sampling_params() == {"top_p": 0.5}
    elsewhere = _with_generation_config(tiny_dir, tmp_path / "other", {"top_k": 7})
    from_dir = LLM(model, generation_config=str(elsewhere), **SMALL)
    assert from_dir.engine.default_sampling_params() == {"top_k": 7}


def test_bad_generation_configs_are_refused_at_start(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="generation_config must be 'auto'"):
        EngineConfig(generation_config="/no/such/directory")
    with pytest.raises(ValueError, match="override_generation_config must be a dict"):
        EngineConfig(override_generation_config=[("temperature", 0.5)])
    model = _with_generation_config(tiny_dir, tmp_path / "model", {"top_p": 0.0})
    with pytest.raises(ValueError, match="pass generation_config='vllm' to ignore them"):
        LLM(str(model), **SMALL)
