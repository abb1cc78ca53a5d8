"""`Tokenizer`: text <-> token ids and the chat template, built from the same source as the weights.

Sources: a GGUF file's embedded vocabulary, merges and chat template, or a HuggingFace
directory's tokenizer files. The BPE itself is HuggingFace `tokenizers` (never hand-written);
chat templates render through transformers, so prompts are byte-identical to what transformers
produces for the same model.

For a byte-level GGUF vocabulary with the default split rule (SmolLM2, GPT-2 style) the
`tokenizers` object is built straight from the arrays the weight loader already read, which takes
a fraction of a second; any other GGUF vocabulary goes through transformers' own GGUF conversion.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# GGUF token types (llama.cpp's llama_token_type): 3 = control (special), 4 = user-defined.
_CONTROL, _USER_DEFINED = 3, 4
# `tokenizer.ggml.pre` values whose split rule is plain byte-level GPT-2 splitting.
_BYTE_LEVEL_DEFAULT_PRE = frozenset({"gpt2", "smollm"})


class Tokenizer:
    """A transformers tokenizer plus the stop tokens the engine needs."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf_tokenizer = hf_tokenizer
        eos_ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos_ids.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_pretrained(cls, directory: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """From a HuggingFace model directory's tokenizer files."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(directory)), eos_token_ids)

    @classmethod
    def from_gguf(
        cls, path: str | Path, metadata: Mapping[str, Any], eos_token_ids: Iterable[int] = ()
    ) -> Tokenizer:
        """From a GGUF file, given its decoded key-values (which the weight loader has)."""
        if _is_plain_byte_level(metadata):
            return cls(_byte_level_from_gguf(metadata), eos_token_ids)
        from transformers import AutoTokenizer

        path = Path(path)
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return cls(hf_tokenizer, eos_token_ids)

    # ------------------------------------------------------------- queries
    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return len(self.hf_tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf_tokenizer.chat_template)

    # ------------------------------------------------------------ encoding
    def encode(self, text: str, add_special_tokens: bool = True,
               max_length: int | None = None) -> list[int]:
        """`text`'s token ids; with `max_length`, only the first `max_length` of them."""
        if max_length is None:
            return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                             truncation=True, max_length=max_length))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf_tokenizer.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf_tokenizer.convert_ids_to_tokens(list(token_ids)))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render `messages` with the model's chat template; token ids, or the text if
        `tokenize` is False. Special tokens come from the template, so none are added. A
        `chat_template=` argument (a Jinja string) replaces the tokenizer's own."""
        if not (self.has_chat_template or template_kwargs.get("chat_template")):
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        text = self.hf_tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _is_plain_byte_level(metadata: Mapping[str, Any]) -> bool:
    """Whether the fast construction reproduces transformers' GGUF conversion exactly."""
    from tokenizers import pre_tokenizers

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        return False
    if metadata.get("tokenizer.ggml.pre", "gpt2") not in _BYTE_LEVEL_DEFAULT_PRE:
        return False
    if metadata.get("tokenizer.ggml.add_bos_token") or metadata.get("tokenizer.ggml.add_eos_token"):
        return False
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    return all(set(token) <= alphabet for token in metadata["tokenizer.ggml.tokens"])


def _byte_level_from_gguf(metadata: Mapping[str, Any]) -> Any:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    raw = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL
    ])
    raw.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True) if kind == _USER_DEFINED
    ])

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
