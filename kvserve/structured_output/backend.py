"""xgrammar, imported lazily (its import pulls transformers and takes seconds), and the
tokenizer description it compiles against, built from kvserve's own tokenizer."""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

_import_lock = threading.Lock()


def xgrammar() -> Any:
    """The xgrammar module; a clear error when it is not installed (`make install` installs
    it with --no-deps: its wheel declares triton)."""
    with _import_lock:
        try:
            import xgrammar as xgr
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError("structured output needs xgrammar: pip install --no-deps "
                               "xgrammar==0.2.8 apache-tvm-ffi") from exc
    return xgr


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's TokenizerInfo for this tokenizer and the model's logits width (`vocab_size`
    may exceed the tokenizer's vocabulary; the extra ids are never allowed)."""
    return _tokenizer_info(_Hashable(tokenizer), vocab_size)


class _Hashable:
    """Keys the cache by the tokenizer object's identity."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __hash__(self) -> int:
        return id(self.tokenizer)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Hashable) and other.tokenizer is self.tokenizer


@lru_cache(maxsize=4)
def _tokenizer_info(key: _Hashable, vocab_size: int):
    xgr = xgrammar()
    tokenizer = key.tokenizer
    backend = tokenizer.backend
    vocab = [""] * max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        vocab[index] = token
    # the vocabulary's encoding (byte-level BPE, SentencePiece byte fallback, raw) as
    # xgrammar reads it from a Hugging Face tokenizer's serialized form, which ours is
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    return xgr.TokenizerInfo(vocab[:vocab_size], vocab_type=metadata["vocab_type"],
                             vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=metadata["add_prefix_space"])
