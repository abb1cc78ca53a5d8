"""`IncrementalDetokenizer`: streaming text, one token at a time.

Decoding each new token alone is wrong twice over: a multi-byte character may be split across
tokens (alone, each half decodes to U+FFFD), and SentencePiece-style decoders drop the leading
space of the first token they see. So each step decodes a short *window* of tokens twice, with
and without the new ones, and emits the difference:

    token ids:   ... | prefix_offset ......... read_offset ...... end |
                       already emitted text     not yet emitted text

Invariants: the text of `ids[:read_offset]` has been emitted in full, and `read_offset` sits on a
character boundary, so decoding may restart there. Text ending in U+FFFD is held back, since the
next token may complete the character; it is emitted once the following token shows it was
really invalid, or by `flush` at the end. Hence the concatenation of every `add` and the final
`flush` equals `decode(all ids)` (for a prompt-seeded detokenizer: the text those ids add after
the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context, so the first output token decodes as it would mid-text.
_NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Take one more token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def add_many(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """At the end of the stream: emit whatever is held back, invalid bytes included."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(
            self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens
        )
