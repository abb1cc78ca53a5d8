"""A model's default sampling parameters, from its `generation_config.json`, as vLLM takes them.

vLLM's `generation_config="auto"` (its default, and ours) makes the sampling fields a model's
`generation_config.json` sets the defaults of every request that leaves them out; `"vllm"`
ignores the file (SamplingParams' own defaults); a directory path reads that directory's file
instead. `override_generation_config` is merged over the result. Only these fields are taken,
HF's `max_new_tokens` under vLLM's name `max_tokens`; everything else in the file (`do_sample`,
`eos_token_id`, ...) is left to whoever reads it (the loader takes the stop tokens).

The result is a plain dict of `SamplingParams` field names to values, empty when the model sets
none: `LLMEngine.default_sampling_params()`, read by `LLM.get_default_sampling_params()` and by
the server for the fields a request leaves out. Light (no torch), as `EngineConfig` checks its
`generation_config` here and the CLI's parser imports that.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # or a directory holding generation_config.json
# generation_config.json's name -> SamplingParams' (the fields vLLM's get_diff_sampling_param
# takes; transformers 5 leaves unset fields None, so every value the file sets counts).
SAMPLING_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def check_generation_config_source(source: str) -> None:
    """ValueError unless `source` is "auto", "vllm" or a directory."""
    if source not in GENERATION_CONFIG_SOURCES and not Path(source).is_dir():
        raise ValueError("generation_config must be 'auto' (the model's "
                         "generation_config.json), 'vllm' (none) or a directory holding one, "
                         f"got {source!r}")


def default_sampling_params(
    source: str,
    model_generation_config: Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The SamplingParams defaults: the sampling fields of the generation config `source`
    names ("auto": the model's, given here), with `overrides` merged over them."""
    if source == "auto":
        config = dict(model_generation_config)
    elif source == "vllm":
        config = {}
    else:
        from kvpool.model.loaders.hf_dir import read_generation_config

        config = read_generation_config(source)
    config.update(overrides or {})
    return {SAMPLING_FIELDS[name]: value for name, value in config.items()
            if name in SAMPLING_FIELDS and value is not None}
