"""Build an HF `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

Byte-level BPE ("gpt2" in GGUF): tokens, merges, special tokens by token type, and the
pre-tokenizer split regexes that llama.cpp uses for `tokenizer.ggml.pre` (so text is split the
way the vocabulary was trained, e.g. one digit at a time for SmolLM). SentencePiece-style
vocabularies ("llama": Gemma, Llama 2, Mistral's older files) are built in sentencepiece_gguf.py.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from kvserve.errors import UnsupportedTokenizerError
from kvserve.tokenizer.sentencepiece_gguf import (
    build_sentencepiece_tokenizer,
    sentencepiece_special_tokens,
)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# OpenAI's o200k (gpt-4o, gpt-oss; Llama 4 reuses it): cased words split at case changes
# ("HelloWorld" -> "Hello", "World"), contractions kept on the word, digits in threes
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regexes llama.cpp applies in order (llama-vocab.cpp)
PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "mpt": [_GPT2_SPLIT],
    "olmo": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "command-r": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
    "gpt-4o": [_O200K_SPLIT],
    "llama4": [_O200K_SPLIT],
    "kanana2": [_O200K_SPLIT],
}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def build_gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _build_sentencepiece(meta)
    if kind != "gpt2":
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported yet (byte-level BPE 'gpt2' and "
            "SentencePiece-style 'llama' are). Use an HF directory with tokenizer.json instead."
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedTokenizerError(
            f"GGUF pre-tokenizer {pre!r} is unknown to kvserve; known: "
            f"{', '.join(sorted(PRE_TOKENIZER_SPLITS))}."
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    alphabet = set(bytes_to_unicode().values())
    spelled = _respell_non_alphabet(tokens, alphabet)
    vocab = {token: index for index, token in enumerate(spelled)}
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, tokens, token_types, alphabet)
    _add_bos_processor(tokenizer, meta, spelled)
    return tokenizer


def _build_sentencepiece(meta: dict[str, Any]) -> Tokenizer:
    tokenizer = build_sentencepiece_tokenizer(meta)
    tokens = list(meta["tokenizer.ggml.tokens"])
    sentencepiece_special_tokens(tokenizer, tokens, list(meta.get("tokenizer.ggml.token_type")
                                                         or []))
    _add_bos_processor(tokenizer, meta, tokens)
    return tokenizer


def _add_bos_processor(tokenizer: Tokenizer, meta: dict[str, Any], spelled: list[str]) -> None:
    """Prepend BOS on encode(add_special_tokens=True) when the file asks for it."""
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return
    bos = spelled[bos_id]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)]
    )


def _respell_non_alphabet(tokens: list[str], alphabet: set[str]) -> list[str]:
    """Tokens already in byte-alphabet form stay; others (rare) are written in it byte by byte."""
    table = bytes_to_unicode()
    return [
        token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))
        for token in tokens
    ]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int],
                        alphabet: set[str]) -> None:
    """Control tokens become special (matched whole, skippable on decode); user-defined tokens
    are matched whole but decoded as text, as llama.cpp does."""
    control, user_defined = [], []
    for token, token_type in zip(tokens, token_types):
        if token_type == _TOKEN_TYPE_CONTROL and set(token) <= alphabet:
            control.append(AddedToken(token, normalized=False, special=True))
        elif token_type == _TOKEN_TYPE_USER_DEFINED:
            user_defined.append(AddedToken(token, normalized=False, special=False))
    if control:
        tokenizer.add_special_tokens(control)
    if user_defined:
        tokenizer.add_tokens(user_defined)
