"""SentencePiece-style GGUF vocabularies (`tokenizer.ggml.model = llama`) against HF transformers
reading the same file: the real Gemma 3 270M GGUF (262,144 tokens, merges recovered from the
vocabulary, byte fallback) and a small Llama-style file written here (scores rank the merges,
a prefix space on the first word)."""

from __future__ import annotations

import pytest

from kvserve.model_source import resolve_model
from kvserve.tokenizer import load_tokenizer
from kvserve.tokenizer.sentencepiece_gguf import merges_from_vocabulary
from tests.helpers import gguf_parsed_once

TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces and   three, trailing  ",
    "tabs\tand\nnewlines\n\n\n",
    "def f(x):\n    return x ** 2  # square\n\n\tpass\n",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🎉🚀 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>a literal bos<eos>",
    "  ",
    "",
    "a",
    "The year 2024: 3.14159, 1,000,000! $5.00 (50%)",
    "Ünïcödé àccents, ß, Ωmega, ﬁ ligature",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "x" * 80,
    "https://example.com/path?q=1&b=2#frag",
    "    indented code\n\tmore\r\nwindows line",
    "\x00\x01 control bytes \x7f",
]


@pytest.fixture(scope="module")
def gemma_source():
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_tokenizers(gemma_source):
    from transformers import AutoTokenizer

    ours = load_tokenizer(gemma_source)
    with gguf_parsed_once():
        theirs = AutoTokenizer.from_pretrained(str(gemma_source.path.parent),
                                               gguf_file=gemma_source.path.name)
    return ours, theirs


def test_gemma_gguf_tokenizes_as_hf(gemma_tokenizers):
    """Ids with the BOS the file asks for, and the text decoded back, for code, CJK, emoji,
    whitespace runs (Gemma stores runs of spaces as real spaces), control and special tokens."""
    ours, theirs = gemma_tokenizers
    for text in TEXTS:
        expected = theirs(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True), text


def test_gemma_special_tokens(gemma_tokenizers):
    ours, theirs = gemma_tokenizers
    assert ours.encode("hi", add_special_tokens=False) == theirs("hi", add_special_tokens=False)[
        "input_ids"]
    turn = ours.encode("<start_of_turn>", add_special_tokens=False)
    assert len(turn) == 1  # a control token is matched whole
    assert ours.encode("x")[0] == 2  # <bos>: add_bos_token is true in the file


def test_merges_follow_rank_then_lengths_then_ids():
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4, "c": 5}
    ranks = {"a": 0.0, "b": 0.0, "ab": -1.0, "abb": -0.5, "bb": -2.0, "c": 0.0}
    # abb (rank -0.5) splits as (a, bb) and (ab, b): longer left first; then ab, then bb
    assert merges_from_vocabulary(vocab, ranks) == [("ab", "b"), ("a", "bb"), ("a", "b"),
                                                    ("b", "b")]


def _llama_spm_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary as llama.cpp writes one: <unk>, <s>, </s>, the 256 byte
    tokens, then pieces whose scores rank the merges (here not in file order)."""
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    pieces = ["▁", "e", "t", "h", "a", "o", "n", "s", "r", "l", "d", "i", "w", "c", "k", "u",
              "▁t", "he", "▁the", "▁a", "an", "▁an", "in", "er", "▁w", "or", "ld", "▁wor",
              "▁world", "ll", "▁he", "llo", "▁hello", "on", "st", "▁s", "en", "▁th", "ing", "▁c"]
    tokens += pieces
    scores += [-float(len(piece)) * 3 + (i % 5) * 0.5 for i, piece in enumerate(pieces)]
    types += [1] * len(pieces)
    return tokens, scores, types


def test_llama_style_gguf_tokenizes_as_hf(tmp_path, monkeypatch):
    """Scores rank the recovered merges; the first word gets the "▁" prefix and decoding strips
    it; bytes outside the vocabulary fall back to <0xNN> tokens."""
    from transformers import AutoTokenizer

    from kvserve.models import random_model
    from kvserve.testing.tiny import tiny_config
    from tests.helpers import write_gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    tokens, scores, types = _llama_spm_vocabulary()
    config = tiny_config(vocab_size=len(tokens), hidden_size=64)
    model = random_model(config, "float32")
    tensors = {name: t.numpy() for name, t in model.hf_state_dict().items()}

    def tokenizer_metadata(writer) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)

    path = tmp_path / "spm.gguf"
    write_gguf(path, config, tensors, metadata=tokenizer_metadata)
    ours = load_tokenizer(resolve_model(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world", "the world and the hello", " leading", "two  spaces",
                 "hello\nworld", "héllo wörld ☃", "stinging", "", "a"]:
        expected = theirs(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert expected[0] == 1  # <s>
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True), text
