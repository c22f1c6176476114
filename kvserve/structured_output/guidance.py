"""llguidance, the second grammar backend, for the JSON schemas xgrammar is slow on.

xgrammar precomputes token masks when it compiles and expands bounded repetition to do so: a
string with maxLength 80 took ~2 s to compile on Zen 3 and its masks inside such strings
1-14 ms a token. llguidance builds masks lazily with a derivative-based lexer, where a bounded
string is one regex: 1-3 ms to start and 0.15-0.6 ms a token on the same schemas; without
bounds xgrammar masks ~2x faster (36 against 68 us). benchmarks/grammar_backends.py,
benchmarks/results/*/2026-11-26-grammar-backends.md. `choose_backend` in compiler.py picks per
request, as vLLM's `auto` does.

`GuidanceMatcher` speaks the part of xgrammar's GrammarMatcher that the mask processor and the
forced-span drafter use, so they need not know which backend a row has."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from kvserve.structured_output.backend import ByIdentity, lazy_import

# JSON whitespace runs are capped as with xgrammar (compiler.MAX_WHITESPACE_RUN)
WHITESPACE_PATTERN = r"[\x20\x0A\x0D\x09]{0,16}"


def llguidance() -> Any:
    return lazy_import("llguidance", "pip install llguidance==1.9.1")


@dataclass(frozen=True)
class GuidanceGrammar:
    """A grammar in llguidance's own serialized form (cheap: the work happens per step)."""

    text: str

    @property
    def memory_size_bytes(self) -> int:
        return len(self.text)


def json_schema_grammar(schema: str, any_whitespace: bool) -> str:
    """Without free whitespace, xgrammar's separators (", " and ": "), so either backend gives
    the same layout (tests/test_structured_output.py compares their masks)."""
    options = ({"whitespace_pattern": WHITESPACE_PATTERN} if any_whitespace
               else {"whitespace_flexible": False, "item_separator": ", ",
                     "key_separator": ": "})
    return llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=options)


def regex_grammar(regex: str) -> str:
    return llguidance().LLMatcher.grammar_from_regex(regex)


def check(text: str, tokenizer=None) -> None:
    """ValueError with llguidance's message when the grammar is not valid."""
    error = llguidance().LLMatcher.validate_grammar(text, tokenizer)
    if error:
        raise ValueError(error)


def guidance_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of our tokenizer (a Hugging Face `tokenizers` object underneath)."""
    return _guidance_tokenizer(ByIdentity(tokenizer), vocab_size)


@lru_cache(maxsize=4)
def _guidance_tokenizer(key: ByIdentity, vocab_size: int):
    import llguidance.hf
    import transformers

    tokenizer = key.tokenizer
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return llguidance.hf.from_tokenizer(wrapped, n_vocab=vocab_size,
                                        eos_token=tokenizer.eos_token_id)


class GuidanceMatcher:
    """One row's llguidance matcher with xgrammar's matcher methods. Stop tokens: any of
    `stop_tokens` ends the row once the grammar accepts (llguidance itself knows one EOS)."""

    def __init__(self, tokenizer, grammar: GuidanceGrammar, stop_tokens: list[int]):
        self._matcher = llguidance().LLMatcher(tokenizer, grammar.text)
        self._stop = list(stop_tokens)
        self._terminated = False

    def is_terminated(self) -> bool:
        return self._terminated

    def accept_token(self, token: int) -> bool:
        if token in self._stop:
            self._terminated = self._matcher.is_accepting()
            return self._terminated
        # not consume_token: a token the grammar forbids would leave llguidance's matcher in
        # an error state for good, where xgrammar's refuses it and stays usable (the drafter
        # tries tokens the grammar may forbid)
        return self._matcher.try_consume_tokens([token]) == 1

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(),
                                              target.numel() * target.element_size())
        if self._stop and self._matcher.is_accepting():
            for token in self._stop:
                target[token // 32] |= _bit(token % 32)

    def find_jump_forward_string(self) -> str:
        return self._matcher.compute_ff_bytes().decode("utf-8", errors="ignore")

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next in the tokenizer's canonical tokenization: the
        forced text's last token is left out where what follows could merge with it (`name"`
        forced before a free-whitespace `:` gives `name`, the model writes `":`)."""
        return self._matcher.compute_ff_tokens()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


def _bit(position: int) -> int:
    """Bit `position` of an int32 word (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32) if position == 31 else 1 << position
