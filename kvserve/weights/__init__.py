"""Weights: files on disk -> (ModelConfig, named tensors); no model math beyond name mapping."""

from kvserve.weights.loader import load_config

__all__ = ["load_config"]
