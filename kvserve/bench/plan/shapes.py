"""The model a plan is for: anything `kvserve serve --model` loads (bundled name, GGUF, HF
directory), an HF config.json of a model too large to run here, or a built-in shape. The
built-in shapes are the published config.json fields of each checkpoint (huggingface.co
meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B, deepseek-ai/DeepSeek-V3), read
through the same family rules as a real checkpoint's config."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.config import ModelConfig
from kvserve.errors import KVServeError

_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 128000,
           "eos_token_id": 128001}

BUILTIN_SHAPES: dict[str, dict] = {
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "deepseek-v3": {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "norm_topk_prob": True, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "hidden_act": "silu",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "weight_block_size": [128, 128],
                                "activation_scheme": "dynamic"}},
}


class PlanInputError(KVServeError):
    """A plan's model, hardware or workload cannot be read (the command line's error)."""


def load_plan_model(reference: str) -> tuple[ModelConfig, bool]:
    """(config, runnable here): a built-in shape or a config.json path is planned only; a
    model the engine loads can also be validated."""
    if reference in BUILTIN_SHAPES:
        return ModelConfig.from_hf_dict(BUILTIN_SHAPES[reference]), False
    path = Path(reference).expanduser()
    if path.name == "config.json" and path.is_file():
        try:
            return ModelConfig.from_hf_dict(json.loads(path.read_text())), False
        except (json.JSONDecodeError, KeyError) as exc:
            raise PlanInputError(f"cannot read {path} as an HF config: {exc}") from exc
    from kvserve.model_source import resolve_model
    from kvserve.weights import load_config

    return load_config(resolve_model(reference)), True
