"""`kvpool export-tokenizer DIR` writes a tokenizer directory that transformers'
`AutoTokenizer` loads and that encodes exactly as the engine does (what lm-eval's
`local-completions` needs); a model without a tokenizer is a one-line error."""

from __future__ import annotations

from pathlib import Path

from kvpool.cli import main
from tests.model.test_loaders import save_tiny_hf_model

TEXTS = ["Hello world, the capital of France is", "  spaces\tand\nnewlines ", "naïve café 東京 🙂",
         "<|im_start|>user\nHi<|im_end|>"]


def test_the_exported_tokenizer_encodes_as_the_engine(smollm2, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert main(["export-tokenizer", str(tmp_path / "tok")]) == 0
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    engine_tokenizer = smollm2.tokenizer
    for text in TEXTS:
        assert exported.encode(text) == engine_tokenizer.encode(text)
    ids = engine_tokenizer.encode(TEXTS[2])
    assert exported.decode(ids) == engine_tokenizer.decode(ids)
    assert (exported.eos_token, exported.bos_token) == ("<|im_end|>", "<|im_start|>")
    messages = [{"role": "user", "content": "Hi"}]
    assert (exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == engine_tokenizer.apply_chat_template(messages, tokenize=False))


def test_a_model_without_a_tokenizer_is_an_error(tmp_path: Path, capsys) -> None:
    save_tiny_hf_model(tmp_path / "tiny")
    assert main(["export-tokenizer", str(tmp_path / "out"), "--model",
                 str(tmp_path / "tiny")]) == 2
    assert "has no tokenizer to export" in capsys.readouterr().err
