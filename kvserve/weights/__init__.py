"""Weights: files on disk -> (ModelConfig, named tensors); no model math beyond name mapping."""

from kvserve.weights.loader import load_config, load_hf_named_tensors

__all__ = ["load_config", "load_hf_named_tensors"]
