"""A HuggingFace directory of a preset's shapes holding the dummy loader's random weights, so
that an engine that loads only real checkpoints (vLLM) races kvpool on the same weights. Every
matrix is drawn in full (no repeated block: `DummyLoader(drawn_elements=None)`), so the logits
have no exact ties and the two engines' greedy tokens can be compared.

    python -m benchmarks.random_checkpoint qwen3-0.6b /tmp/qwen3-0.6b [--dtype bfloat16]

`config.json` is the preset's own fields (`kvpool.model.presets.preset_config_json`) plus the
`architectures` entry vLLM picks its model class by. The real tokenizers cannot be downloaded
here, so the directory gets the bundled SmolLM2 tokenizer: its ids (< 49152) lie inside every
preset's vocabulary, which is all a throughput run with `ignore_eos` needs of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def write_random_checkpoint(name: str, directory: Path, dtype: str = "bfloat16") -> Path:
    """Write preset `name` with the dummy loader's weights (seed 0, every matrix drawn in full)
    in `dtype` as a HuggingFace directory at `directory`; returns it. Written aside and moved,
    so a partial write never stands in for a whole one."""
    import torch
    from safetensors.torch import save_file

    from kvpool.model.loaders.dummy import DummyLoader
    from kvpool.model.presets import preset

    config, fields = preset(name), checkpoint_config_json(name, dtype)
    if config.vocab_size < 49152:
        raise ValueError(f"{name}'s vocabulary ({config.vocab_size}) is smaller than SmolLM2's")
    partial = directory.with_name(directory.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    cpu = torch.device("cpu")
    weights = {hf_name(key): tensor.to(getattr(torch, dtype)).contiguous() for key, tensor
               in DummyLoader(config, drawn_elements=None).iter_weights(config, cpu)}
    weights = fused_as_transformers_names(weights, set(transformers_shapes(fields)))
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(fields, indent=1))
    _copy_tokenizer(partial)
    partial.rename(directory)
    return directory


def checkpoint_config_json(name: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """The `config.json` fields of preset `name` as a checkpoint in `dtype` holds them: the
    preset's own fields plus the `architectures` entry vLLM picks its model class by."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from kvpool.model.presets import preset_config_json

    fields = preset_config_json(name)
    fields["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[fields["model_type"]]]
    fields["torch_dtype"] = dtype
    return fields


def transformers_shapes(fields: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors a transformers checkpoint of `fields` holds (a tied head
    left out), from its causal LM built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = {"lm_head.weight"} if config.get_text_config().tie_word_embeddings else set()
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}


def fused_as_transformers_names(weights: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """`weights` with the parts of each projection transformers keeps fused (Phi-3's
    `qkv_proj`, `gate_up_proj`: `kvpool.model.fused_weights`) joined under its name."""
    import torch

    from kvpool.model.fused_weights import FUSED_PARTS

    joined = dict(weights)
    for name in names - set(weights):
        parts = name.split(".")  # model.layers.N.<module>.<module>.weight
        module = ".".join(parts[3:5])
        if len(parts) != 6 or module not in FUSED_PARTS:
            continue
        prefix, kind = ".".join(parts[:3]), parts[5]
        joined[name] = torch.cat([joined.pop(f"{prefix}.{part}.{kind}")
                                  for part in FUSED_PARTS[module]])
    return joined


def hf_name(name: str) -> str:
    """The HuggingFace name of a kvpool checkpoint tensor name (the decoder's under `model.`)."""
    return name if name == "lm_head.weight" else f"model.{name}"


def _copy_tokenizer(directory: Path) -> None:
    from benchmarks.hf_export import hf_directory_for
    from kvpool.model import default_model_path

    source = hf_directory_for(default_model_path())
    for file in TOKENIZER_FILES:
        if (source / file).exists():
            shutil.copy(source / file, directory / file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.random_checkpoint",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", help="a kvpool preset name (e.g. qwen3-0.6b)")
    parser.add_argument("directory", type=Path, help="where to write it (must not exist)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    if args.directory.exists():
        print(f"random_checkpoint: error: {args.directory} exists", file=sys.stderr)
        return 2
    print(write_random_checkpoint(args.preset, args.directory, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
