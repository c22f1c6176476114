"""Which FamilyRules read which architecture's configs: the built-in families' and those a
plugin registers (kvserve.models.register_model passes its `config_rules` here)."""

from __future__ import annotations

from kvserve.config.builtin_families import BUILTIN_RULES
from kvserve.config.families import FamilyRules

_rules: dict[str, FamilyRules] = {rules.architecture: rules for rules in BUILTIN_RULES}


def register_family_rules(rules: FamilyRules) -> None:
    """Read configs of `rules.architecture` by `rules` (a later registration replaces)."""
    if not rules.architecture:
        raise ValueError(f"{type(rules).__name__} names no architecture")
    _rules[rules.architecture] = rules


def family_rules(architecture: str) -> FamilyRules:
    """The architecture's rules; the base class's for one that registered none."""
    return _rules.get(architecture) or FamilyRules(architecture)


def architecture_of_hf_model_type(model_type: str | None) -> str | None:
    """Our architecture name for an HF model_type (the GGUF name where they differ)."""
    for rules in list(_rules.values()):
        if rules.hf_model_type is not None and rules.hf_model_type == model_type:
            return rules.architecture
    return model_type


def moe_gguf_architectures() -> list[str]:
    """The GGUF general.architecture names of the mixtures of experts kvserve reads."""
    return sorted((r.gguf_architecture or r.architecture) for r in list(_rules.values())
                  if r.is_moe)


def architecture_of_gguf(gguf_architecture: str | None, has_experts: bool) -> str | None:
    """Our architecture name for a GGUF's general.architecture (and whether the file has
    experts: llama.cpp writes Mixtral as "llama")."""
    named = [rules for rules in list(_rules.values())
             if (rules.gguf_architecture or rules.architecture) == gguf_architecture]
    for rules in named:
        if rules.is_moe == has_experts:
            return rules.architecture
    return named[0].architecture if named else gguf_architecture
