"""A HuggingFace model directory made from a GGUF file, for engines that cannot read GGUF offline.

vLLM reads a GGUF file's weights but needs the HuggingFace tokenizer files, which it fetches
from the Hub; offline it cannot start. transformers can load the GGUF (`gguf_file=`) but will
not `save_pretrained` a model loaded that way, so the weights are copied into a fresh model of
the same config and that one is saved, with the tokenizer. The quantisation note that GGUF
loading leaves in the config is dropped: the saved weights are plain tensors.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def export_cache_dir() -> Path:
    """Where exported directories are kept: $KVPOOL_CACHE_DIR, else ~/.cache/kvpool."""
    root = os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool"
    return Path(root) / "hf-export"


def hf_directory_for(gguf_path: Path) -> Path:
    """The exported directory of `gguf_path`, made on first use (keyed by the file's path,
    size and modification time, so a changed file is exported again)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    target = export_cache_dir() / f"{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    if not (target / "config.json").exists():
        export_gguf(gguf_path, target)
    return target


def export_gguf(gguf_path: Path, target: Path) -> None:
    """Write `gguf_path` as a HuggingFace directory (safetensors, config, tokenizer) at
    `target`; a partial export never stands in for a whole one (written aside, then moved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(source)(config)
    model.load_state_dict(source.state_dict())
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
