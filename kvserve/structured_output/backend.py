"""xgrammar, imported lazily (its import pulls transformers and takes seconds), and the
tokenizer description it compiles against, built from kvserve's own tokenizer."""

from __future__ import annotations

import importlib
import threading
from functools import lru_cache
from typing import Any

_import_lock = threading.Lock()


def lazy_import(name: str, install_hint: str) -> Any:
    """A grammar backend's module, imported on first use under one lock (imports take
    seconds); a clear error naming how to install it when it is missing."""
    with _import_lock:
        try:
            return importlib.import_module(name)
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError(f"structured output needs {name}: {install_hint}") from exc


def xgrammar() -> Any:
    """The xgrammar module (`make install` installs it with --no-deps: its wheel declares
    triton)."""
    return lazy_import("xgrammar", "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi")


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's TokenizerInfo for this tokenizer and the model's logits width (`vocab_size`
    may exceed the tokenizer's vocabulary; the extra ids are never allowed)."""
    return _tokenizer_info(ByIdentity(tokenizer), vocab_size)


class ByIdentity:
    """Keys the cache by the tokenizer object's identity."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __hash__(self) -> int:
        return id(self.tokenizer)

    def __eq__(self, other) -> bool:
        return isinstance(other, ByIdentity) and other.tokenizer is self.tokenizer


@lru_cache(maxsize=4)
def _tokenizer_info(key: ByIdentity, vocab_size: int):
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
