"""A tiny random Llama (2 layers, small dims) with the real SmolLM2 tokenizer, for fast tests.

`write_tiny_model_dir` saves it as an HF directory, so the whole engine (`LLM(model=dir)`) can be
exercised in milliseconds per step.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.config import ModelConfig


def tiny_config(vocab_size: int = 49152, **overrides) -> ModelConfig:
    fields = dict(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def write_tiny_model_dir(directory: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors and the tokenizer files of a tiny random model."""
    from safetensors.torch import save_file

    from kvserve.models import random_model

    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**overrides)
    model = random_model(config, "float32", seed=seed)
    save_file({k: v.contiguous() for k, v in model.hf_state_dict().items()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=1))
    write_tokenizer_files(directory, tokenizer)
    return directory


def write_tokenizer_files(directory: Path, tokenizer) -> None:
    """A kvserve tokenizer's files, so an HF directory (ours or one HF transformers saved) can
    serve through the whole engine. The class is named so HF's AutoTokenizer (which llama.cpp's
    converter uses) reads tokenizer.json as it is, not as the model family's own class."""
    (directory / "tokenizer.json").write_text(tokenizer.backend.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.special_tokens.get("bos_token"),
        "eos_token": tokenizer.special_tokens.get("eos_token"),
    }))
