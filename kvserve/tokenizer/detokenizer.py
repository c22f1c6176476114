"""Incremental detokenization: text deltas as token ids arrive.

Multi-byte UTF-8 characters split across tokens are held back until complete (the library's
DecodeStream buffers bytes), so a stream never emits U+FFFD halves.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: list[int] | None = None):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""
        if prompt_token_ids:
            # Seed the stream with the prompt's tail so the first output token decodes with the
            # right leading space; the seeded text is not part of the output.
            for token_id in prompt_token_ids[-4:]:
                self._stream.step(tokenizer, token_id)

    def add(self, token_id: int) -> str:
        """Feed one token; return the new text it completes ('' while a character is pending)."""
        delta = self._stream.step(self._tokenizer, token_id) or ""
        self.text += delta
        return delta
