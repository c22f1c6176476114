"""GGUF byte-level BPE pre-tokenizers (`tokenizer.ggml.pre`) against their sources.

OpenAI's o200k split (gpt-oss's GGUFs say "gpt-4o"; Llama 4's "llama4") is checked against the
pattern tiktoken itself ships for o200k_base, applied by the `regex` module as tiktoken's own
tests do: the vocabulary file cannot be downloaded here, and the split is what the GGUF's
`pre` names (the merges are the file's own)."""

from __future__ import annotations

import pytest

from kvserve.tokenizer.gguf_tokenizer import (
    PRE_TOKENIZER_SPLITS,
    build_gguf_tokenizer,
    bytes_to_unicode,
)

# case changes inside words, contractions in both cases, digit runs, code, newlines and slashes,
# accents and marks, CJK, emoji, runs of spaces
TEXT = ("HelloWorld isn't it? I'M here, they'LL see. CamelCaseName XMLHttpRequest iPhone\n"
        "1234567 3.14159 $1,000,000\t\tdone  \n\n  path/to/file.py:12 ==> x+=1;\r\n"
        "naïve café Ünïcödé ÀÉÎ e\u0301 Ελληνικά Русский 日本語のテキスト 한국어 😀👍 \n"
        "def f(x):\n    return x**2  # note\n   \n")


@pytest.fixture(scope="module")
def o200k_pattern() -> str:
    import tiktoken_ext.openai_public as tiktoken_openai

    original = tiktoken_openai.load_tiktoken_bpe
    tiktoken_openai.load_tiktoken_bpe = lambda *args, **kwargs: {}  # no download: the pattern
    try:
        return tiktoken_openai.o200k_base()["pat_str"]
    finally:
        tiktoken_openai.load_tiktoken_bpe = original


def _gguf_meta(pre: str) -> dict:
    """A byte-level vocabulary (the 256 bytes and a few merges) with `pre` as its split."""
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(256)]
    merges = []
    for left, right in [("H", "e"), ("He", "l"), ("l", "o"), ("Hel", "lo"), ("Ġ", "t"),
                        ("W", "o"), ("Wo", "r"), ("r", "l"), ("d", "1")]:
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * len(tokens),
            "tokenizer.ggml.merges": merges}


def _pieces(tokenizer, text: str) -> list[str]:
    """The pre-tokenizer's pieces as text (byte-level spelling undone)."""
    from_unicode = {char: byte for byte, char in bytes_to_unicode().items()}
    return [bytes(from_unicode[c] for c in piece).decode("utf-8")
            for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", ["gpt-4o", "llama4"])
def test_o200k_split_matches_tiktoken(pre, o200k_pattern):
    import regex

    tokenizer = build_gguf_tokenizer(_gguf_meta(pre))
    assert _pieces(tokenizer, TEXT) == regex.findall(o200k_pattern, TEXT)


def test_o200k_split_differs_from_gpt2s(o200k_pattern):
    """The text tells the splits apart, so the test above would catch a wrong mapping."""
    import regex

    gpt2 = build_gguf_tokenizer(_gguf_meta("gpt-2"))
    assert _pieces(gpt2, TEXT) != regex.findall(o200k_pattern, TEXT)
    assert "".join(_pieces(gpt2, TEXT)) == TEXT


def test_o200k_encodes_with_the_files_merges_and_round_trips():
    tokenizer = build_gguf_tokenizer(_gguf_meta("gpt-4o"))
    ids = tokenizer.encode("HelloWorld", add_special_tokens=False).ids
    # the merges in rank order: "Hello" whole; in "World", "Wo r" ranks before "r l"
    assert [tokenizer.id_to_token(i) for i in ids] == ["Hello", "Wor", "l", "d"]
    assert tokenizer.decode(tokenizer.encode(TEXT, add_special_tokens=False).ids) == TEXT


def test_every_split_compiles():
    for pre in PRE_TOKENIZER_SPLITS:
        build_gguf_tokenizer(_gguf_meta(pre)).encode(TEXT)
