"""SentencePiece-style GGUF vocabularies (`tokenizer.ggml.model = llama`) as an HF `tokenizers`
BPE tokenizer with byte fallback, built the way HF transformers builds them from the same file
(its GGUF tokenizer mapping), so both split every text into the same ids.

The file holds tokens, scores and token types but no merges. BPE merges are recovered from the
vocabulary: every split of a token into two tokens of the vocabulary is a merge, ranked by the
token's score (best first), or for the Gemma family by the token's place in the file (Gemma's
scores do not follow its merge order; its file order does). Gemma files also store tokens made of
two or more spaces as real spaces, where the tokenizer looks them up as "▁" runs.

Families differ in how a space becomes "▁": Gemma replaces every space and adds no prefix space;
Llama-style files prepend "▁" to the first word (Metaspace, prepend "first") and strip it again
when decoding.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # SentencePiece's visible space
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma3_text")

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def build_sentencepiece_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a `llama`-model GGUF; special tokens, BOS/EOS handling are the caller's
    (shared with the byte-level builder)."""
    architecture = meta.get("general.architecture", "llama")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    gemma = architecture in GEMMA_ARCHITECTURES
    if gemma:
        tokens = [SPACE * len(t) if t and " " in t and not t.strip() else t for t in tokens]
        ranks = {token: -index for index, token in enumerate(tokens)}
    else:
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        ranks = dict(zip(tokens, scores))
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab=vocab, merges=merges_from_vocabulary(vocab, ranks), fuse_unk=True,
                       byte_fallback=True,
                       unk_token=tokens[unk_id] if gemma and unk_id is not None else None)
    tokenizer = Tokenizer(model)
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", SPACE)
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE,
                                                           prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(content=" ", left=1)])
    return tokenizer


def merges_from_vocabulary(vocab: dict[str, int],
                           ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of vocabulary tokens that spells a vocabulary token, ordered by
    that token's rank (highest first), then by the lengths of left and right (longest first),
    then by the ids of left and right: the order HF transformers derives (a BPE tokenizer applies
    the first applicable merge, so the order decides the split)."""
    found = []
    for token, rank in ranks.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                 if token[:cut] in vocab and token[cut:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((left, right, rank) for left, right in pairs)
    # stable: equal keys keep the per-token id order above
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def sentencepiece_special_tokens(tokenizer: Tokenizer, tokens: list[str],
                                 token_types: list[int]) -> None:
    """Control tokens (`<bos>`, `<start_of_turn>`) become special, matched whole and skippable on
    decode; user-defined ones are matched whole and decoded as text."""
    vocab = tokenizer.get_vocab()
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL]
    user_defined = [AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, token_types)
                    if kind == _TOKEN_TYPE_USER_DEFINED and token in vocab]
    if control:
        tokenizer.add_special_tokens(control)
    if user_defined:
        tokenizer.add_tokens(user_defined)
