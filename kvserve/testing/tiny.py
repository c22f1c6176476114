"""A tiny random Llama (2 layers, small dims) with the real SmolLM2 tokenizer, for fast tests."""

from __future__ import annotations

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
