"""Tokenizers (HF `tokenizers`), chat templates (jinja2) and incremental detokenization."""

from kvserve.tokenizer.detokenizer import IncrementalDetokenizer
from kvserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]
