"""The Tokenizer kvserve uses everywhere: encode/decode, special ids and the chat template.

Built from GGUF metadata or from an HF directory's tokenizer.json + tokenizer_config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kvserve.errors import CorruptModelFileError, UnsupportedTokenizerError
from kvserve.model_source import ModelSource
from kvserve.tokenizer.chat_template import render_chat_template
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    special_tokens: dict[str, str | None] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> set[int]:
        decoder = self.backend.get_added_tokens_decoder()
        return {index for index, token in decoder.items() if token.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # BOS (when the model wants one) comes from the backend's post-processor, as in HF.
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = True,
                    prompt_token_ids: list[int] | None = None) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.backend, skip_special_tokens, prompt_token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt=True,
                            chat_template: str | None = None, **extra: Any) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise UnsupportedTokenizerError(
                "this model has no chat template; send plain completions instead"
            )
        return render_chat_template(template, messages, add_generation_prompt,
                                    self.special_tokens, **extra)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt=True,
                    chat_template: str | None = None, **extra: Any) -> dict[str, Any]:
        """The conversation as a prompt dict: the template's text and its token ids (encoded
        without special tokens: the template already holds any BOS it wants). The one place
        every caller (engine, server, CLI, router) turns messages into tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template, **extra)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.format == "gguf":
        return _from_gguf(source.path)
    return _from_hf_dir(source.path)


def _from_gguf(path: Path) -> Tokenizer:
    """Build from GGUF metadata once; later loads read the serialized result from the cache."""
    from kvserve.weights.cache import cached_json

    spec = cached_json(path, "tokenizer.json", lambda: _gguf_tokenizer_spec(path))
    return Tokenizer(
        backend=HFTokenizer.from_str(spec["backend"]),
        bos_token_id=spec["bos_token_id"],
        eos_token_id=spec["eos_token_id"],
        chat_template=spec["chat_template"],
        special_tokens=spec["special_tokens"],
    )


def _gguf_tokenizer_spec(path: Path) -> dict[str, Any]:
    from kvserve.tokenizer.gguf_tokenizer import build_gguf_tokenizer
    from kvserve.weights.gguf_file import open_gguf, read_metadata

    meta = read_metadata(open_gguf(path), include_bulky=True)
    if "tokenizer.ggml.tokens" not in meta:
        raise CorruptModelFileError(f"{path} has no tokenizer (tokenizer.ggml.tokens missing)")
    backend = build_gguf_tokenizer(meta)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "backend": backend.to_str(),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "chat_template": meta.get("tokenizer.chat_template"),
        "special_tokens": {
            "bos_token": backend.id_to_token(bos) if bos is not None else None,
            "eos_token": backend.id_to_token(eos) if eos is not None else None,
        },
    }


def _from_hf_dir(directory: Path) -> Tokenizer:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CorruptModelFileError(f"{directory} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(tokenizer_file))
    config = _read_json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        template = template_file.read_text()
    elif isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    bos_text = _token_text(config.get("bos_token"))
    eos_text = _token_text(config.get("eos_token"))
    model_config = _read_json(directory / "config.json")
    bos = backend.token_to_id(bos_text) if bos_text else model_config.get("bos_token_id")
    eos = backend.token_to_id(eos_text) if eos_text else model_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return Tokenizer(
        backend=backend,
        bos_token_id=bos,
        eos_token_id=eos,
        chat_template=template,
        special_tokens={"bos_token": bos_text, "eos_token": eos_text},
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModelFileError(f"{path} is not valid JSON: {exc}") from exc


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
