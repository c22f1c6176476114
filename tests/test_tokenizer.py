"""Tokenizer, chat template and incremental detokenizer against HF's for the same GGUF."""

from __future__ import annotations

import pytest

TEXTS = [
    "Hello, world!",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass Foo:\n\tpass\n",
    "Prices: 12345, 3.14159, -42 and 1e10; phone 555-0100.",
    "naïve café résumé — “quotes” and ‘single’ … ellipsis",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Emoji: 😀🎉👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵",
    "   leading spaces, trailing   \n\n\n   multiple\t\ttabs    and     runs      ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> special in the middle <|im_end|> of text",
    "It's we'll they've I'm you'd she'll 'quoted'",
    "ALL CAPS and MiXeD cAsE and snake_case and camelCase",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "",
    "\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text).input_ids


def test_decode_round_trips_and_matches_hf(tokenizer, hf_tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_digits_split_one_at_a_time(tokenizer):
    """SmolLM's pre-tokenizer (`smollm`) isolates every digit, as llama.cpp does."""
    ids = tokenizer.encode("2024")
    assert len(ids) == 4
    assert tokenizer.decode(ids) == "2024"


def test_special_token_ids(tokenizer):
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == 2
    assert tokenizer.encode("<|im_end|>") == [2]
    assert {1, 2} <= tokenizer.all_special_ids


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Arr!"},
     {"role": "user", "content": "Où est le trésor? 🏴‍☠️"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    reference = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == reference


def test_chat_template_helpers():
    from kvserve.tokenizer.chat_template import TemplateError, render_chat_template

    template = (
        "{% if messages|length == 0 %}{{ raise_exception('empty') }}{% endif %}"
        "{% for m in messages %}{{ m | tojson }}{% generation %}!{% endgeneration %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    assert render_chat_template(template, [{"role": "user", "content": "é"}]) == (
        '{"role": "user", "content": "é"}!4')
    with pytest.raises(TemplateError, match="empty"):
        render_chat_template(template, [])


def test_incremental_detokenizer_handles_split_utf8(tokenizer):
    text = "Emoji 👨‍👩‍👧‍👦 and 日本語 and café"
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer()
    deltas = [detok.add(token_id) for token_id in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    # at least one token completes no character on its own (a multi-byte split)
    assert "" in deltas


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi<|im_end|>")
    detok = tokenizer.detokenizer(skip_special_tokens=True)
    assert "".join(detok.add(i) for i in ids) == "Hi"
