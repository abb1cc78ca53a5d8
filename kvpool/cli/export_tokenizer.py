"""`kvpool export-tokenizer DIR [--model MODEL]`: write the model's tokenizer as a HuggingFace
tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template, special
tokens map), so tools that load tokenizers with `AutoTokenizer.from_pretrained` can count
tokens exactly as `kvpool serve` does: lm-evaluation-harness's `local-completions`
(`tokenizer=DIR`, docs/lm_eval.md), or a client computing prompt lengths.

The tokenizer is the one the engine uses (a GGUF file's is rebuilt from its metadata, as
the engine does), so the directory's `encode` gives the same ids as the server's /tokenize.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-tokenizer", help="write the model's tokenizer as a HuggingFace directory")
    parser.add_argument("directory", metavar="DIR", help="where to write it (created)")
    parser.add_argument("--model", default=None,
                        help="GGUF file, HF directory or Hub id in the local cache "
                             "(default: SmolLM2-135M-Instruct)")
    parser.set_defaults(func=run)


def export_tokenizer(model: str | None, directory: Path) -> list[str]:
    """Write `model`'s tokenizer to `directory`; the names of the files written. ValueError
    for a model without a tokenizer."""
    from kvpool.model.loaders.auto import make_loader

    tokenizer = make_loader(model).load_tokenizer()
    if tokenizer is None:
        raise ValueError(f"{model or 'the model'} has no tokenizer to export")
    directory.mkdir(parents=True, exist_ok=True)
    written = tokenizer.hf_tokenizer.save_pretrained(str(directory))
    return sorted(Path(path).name for path in written)


def run(args: argparse.Namespace) -> int:
    files = export_tokenizer(args.model, Path(args.directory))
    print(f"wrote {', '.join(files)} to {args.directory}", file=sys.stderr)
    return 0
