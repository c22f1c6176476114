"""The built-in model families, by name: importing this package registers each architecture
with the "module:Class" that implements it (models/registry.py), so checking a name imports no
model code. Each module is one family (or a few that share its computation), composed of the
shared layers in kvserve/models/layers/."""

from kvserve.models.registry import register_model

BUILTIN_FAMILIES = {
    "llama": "llama:LlamaForCausalLM",
    "mistral": "llama:LlamaForCausalLM",
    "smollm3": "llama:LlamaForCausalLM",
    "qwen2": "qwen:Qwen2ForCausalLM",
    "qwen3": "qwen:Qwen3ForCausalLM",
    "phi3": "phi3:Phi3ForCausalLM",
    "gemma2": "gemma:Gemma2ForCausalLM",
    "gemma3": "gemma:Gemma3ForCausalLM",
    "mixtral": "moe:MixtralForCausalLM",
    "qwen2_moe": "moe:Qwen2MoeForCausalLM",
    "qwen3_moe": "moe:Qwen3MoeForCausalLM",
    "olmoe": "moe:OlmoeForCausalLM",
    "gpt_oss": "gpt_oss:GptOssForCausalLM",
    "deepseek_v2": "deepseek:DeepseekV3ForCausalLM",
    "deepseek_v3": "deepseek:DeepseekV3ForCausalLM",
}

for _architecture, _where in BUILTIN_FAMILIES.items():
    register_model(_architecture, f"{__name__}.{_where}")
