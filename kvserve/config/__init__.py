"""The model's configuration: `ModelConfig` (one frozen dataclass, whatever the checkpoint
format) and the per-family rules that read it from HF configs and GGUF metadata
(families.py; the built-in families' in builtin_families.py). Torch-free."""

from kvserve.config.families import FamilyRules
from kvserve.config.registry import (
    architecture_of_gguf,
    architecture_of_hf_model_type,
    family_rules,
    register_family_rules,
)
from kvserve.config.model_config import ACTIVATIONS, ModelConfig

__all__ = ["ACTIVATIONS", "FamilyRules", "ModelConfig", "architecture_of_gguf",
           "architecture_of_hf_model_type",
           "family_rules", "register_family_rules"]
