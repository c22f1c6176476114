"""The config rules of the built-in families (their model code is in kvserve/models/families/):
what each family's HF config class and llama.cpp's converter do differently from the shared
reading in families.FamilyRules."""

from __future__ import annotations

import math
from typing import Any

from kvserve.config.families import FamilyRules, one_window_size
from kvserve.errors import UnsupportedArchitectureError


class Llama(FamilyRules):
    architecture = "llama"
    gguf_permuted_qk = True

    def hf_sliding_windows(self, hf: dict[str, Any]) -> tuple[int | None, ...]:
        return ()  # LlamaConfig has no window


class _EveryLayerWindow(FamilyRules):
    """Configs whose `sliding_window` windows every layer (absent: the class default; null:
    none) and which ignore `layer_types`."""

    default_window: int | None = None

    def hf_sliding_windows(self, hf: dict[str, Any]) -> tuple[int | None, ...]:
        window = hf.get("sliding_window", self.default_window)
        return (window,) * hf["num_hidden_layers"] if window is not None else ()

    def hf_window_fields(self, config) -> dict[str, Any]:
        window = one_window_size(config)
        if window is not None and None in config.sliding_windows:
            raise ValueError(f"HF {self.architecture} windows every layer or none")
        return {"sliding_window": window}


class Mistral(_EveryLayerWindow):
    architecture = "mistral"
    hf_class_name = "MistralForCausalLM"
    default_window = 4096
    gguf_permuted_qk = True


class Phi3(_EveryLayerWindow):
    """Phi-3 and Phi-4-mini: fused QKV and gate/up projections, LongRoPE under old names."""

    architecture = "phi3"
    hf_class_name = "Phi3ForCausalLM"
    rope_type_aliases = {"su": "longrope", "yarn": "longrope"}  # Phi3Config's own mapping
    original_context_default = 4096
    gguf_layer_names = {  # llama.cpp's ffn_up holds gate then up
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_qkv.bias": "self_attn.qkv_proj.bias",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    }


class Qwen2(FamilyRules):
    """Qwen2 drops `sliding_window` unless `use_sliding_window`; its windowed layers are
    `layer_types`, or else those from index `max_window_layers` on."""

    architecture = "qwen2"
    hf_class_name = "Qwen2ForCausalLM"
    attention_bias_by_default = True

    def hf_sliding_windows(self, hf: dict[str, Any]) -> tuple[int | None, ...]:
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        first = hf.get("max_window_layers", 28)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(hf["num_hidden_layers"])]
        return super().hf_sliding_windows(dict(hf, sliding_window=window,
                                               layer_types=layer_types))

    def hf_window_fields(self, config) -> dict[str, Any]:
        fields = super().hf_window_fields(config)
        if fields:
            fields["use_sliding_window"] = True
            fields["max_window_layers"] = fields["layer_types"].index("sliding_attention")
        return fields


class Qwen3(Qwen2):
    architecture = "qwen3"
    hf_class_name = "Qwen3ForCausalLM"
    attention_bias_by_default = False
    qk_norm = True


class SmolLM3(FamilyRules):
    """Llama with no RoPE on some layers (HF's `no_rope_layers`, llama.cpp's every 4th)."""

    architecture = "smollm3"
    hf_class_name = "SmolLM3ForCausalLM"
    tied_by_default = True
    gguf_permuted_qk = True
    gguf_no_rope_every = 4

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(super().from_hf(hf), rope_layers=tuple(hf.get("no_rope_layers") or ()))

    def to_hf(self, config) -> dict[str, Any]:
        hf = super().to_hf(config)
        if config.rope_layers:
            hf["no_rope_layers"] = [int(r) for r in config.rope_layers]
        return hf


class Gemma2(FamilyRules):
    """Norms scale by (1 + weight) in float32, around attention and MLP both (before and
    after), a GeGLU MLP, the embedding scaled by sqrt(hidden), attention scaled by
    query_pre_attn_scalar, scores and logits soft-capped."""

    architecture = "gemma2"
    hf_class_name = "Gemma2ForCausalLM"
    tied_by_default = True
    window_pattern = 2
    # llama.cpp's ffn_norm is the MLP's input norm, as in Llama, but HF names it
    # pre_feedforward_layernorm here (post_attention_layernorm normalises attention's output)
    gguf_layer_names = {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }
    # the 27B scales queries by hidden / heads, not head_dim (llama.cpp's LLM_TYPE_27B, by
    # layer count; HF configs say so in query_pre_attn_scalar)
    layers_of_27b = 46

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(super().from_hf(hf), **self._gemma_fields(hf["hidden_size"], hf))

    def to_hf(self, config) -> dict[str, Any]:
        return dict(super().to_hf(config), query_pre_attn_scalar=config.scale**-2,
                    attn_logit_softcapping=config.attn_logit_softcapping,
                    final_logit_softcapping=config.final_logit_softcapping)

    def gguf_fields(self, meta: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        arch, hidden = self.architecture, fields["hidden_size"]
        hf_like = {"attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
                   "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping")}
        if fields["num_hidden_layers"] == self.layers_of_27b:
            hf_like["query_pre_attn_scalar"] = hidden // fields["num_attention_heads"]
        return dict(self._gemma_fields(hidden, hf_like), hidden_act="gelu_pytorch_tanh")

    @staticmethod
    def _gemma_fields(hidden_size: int, hf: dict[str, Any]) -> dict[str, Any]:
        scalar = hf.get("query_pre_attn_scalar")
        return {
            "norm_weight_offset": 1.0,
            "sandwich_norms": True,
            "embedding_multiplier": hidden_size**0.5,
            "attention_scale": None if scalar is None else float(scalar) ** -0.5,
            "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
            "final_logit_softcapping": hf.get("final_logit_softcapping"),
        }


class Gemma3(Gemma2):
    """Gemma 2's layers with QK-norm, and a second RoPE base for the sliding layers; served as
    its text model (HF's gemma3_text)."""

    architecture = "gemma3"
    hf_model_type = "gemma3_text"
    hf_class_name = "Gemma3ForCausalLM"
    qk_norm = True
    window_pattern = 6
    gguf_local_rope_theta = 10000.0  # llama.cpp's rope_freq_base_train_swa for the family
    layers_of_27b = 62


def _expert_names(moe: str, gate: str, up: str, down: str) -> dict[str, str]:
    """llama.cpp's MoE tensor names -> ours, under the block's name `moe`."""
    return {"ffn_gate_inp.weight": f"{moe}.gate.weight",
            "ffn_gate_exps.weight": f"{moe}.experts.{{}}.{gate}.weight",
            "ffn_up_exps.weight": f"{moe}.experts.{{}}.{up}.weight",
            "ffn_down_exps.weight": f"{moe}.experts.{{}}.{down}.weight"}


class Mixtral(_EveryLayerWindow):
    """Mistral's layers with a mixture of experts in each (softmax top-k, renormalised).
    llama.cpp's converter writes it as a "llama" file with an expert count, Q/K rows
    permuted."""

    architecture = "mixtral"
    hf_class_name = "MixtralForCausalLM"
    is_moe = True
    gguf_architecture = "llama"
    gguf_permuted_qk = True
    gguf_norm_topk_prob = True
    gguf_layer_names = _expert_names("block_sparse_moe", "w1", "w3", "w2")

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(super().from_hf(hf), num_experts=hf["num_local_experts"],
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)

    def to_hf(self, config) -> dict[str, Any]:
        return dict(super().to_hf(config), num_local_experts=config.num_experts,
                    num_experts_per_tok=config.num_experts_per_tok)


class _QwenMoE(Qwen2):
    """Qwen2-MoE and Qwen3-MoE: the mixture on the layers `decoder_sparse_step` and
    `mlp_only_layers` leave sparse, top-k of a softmax renormalised if `norm_topk_prob`."""

    is_moe = True
    gguf_layer_names = dict(_expert_names("mlp", "gate_proj", "up_proj", "down_proj"), **{
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"})

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        # the hub's configs say num_experts; transformers 5 writes num_local_experts
        experts = hf.get("num_experts", hf.get("num_local_experts", 0)) or 0
        step = hf.get("decoder_sparse_step", 1) or 1
        dense = set(hf.get("mlp_only_layers") or ())
        layers = hf["num_hidden_layers"]
        return dict(super().from_hf(hf), num_experts=experts,
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["moe_intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    moe_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                                     for i in range(layers)))

    def to_hf(self, config) -> dict[str, Any]:
        layers = range(config.num_hidden_layers)
        return dict(super().to_hf(config), num_experts=config.num_experts,
                    num_experts_per_tok=config.num_experts_per_tok,
                    moe_intermediate_size=config.moe_intermediate_size,
                    norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1,
                    mlp_only_layers=[i for i in layers if not config.is_moe_layer(i)])


class Qwen2MoE(_QwenMoE):
    """Qwen1.5-MoE / Qwen2-MoE: Q/K/V biases (`qkv_bias`), a shared expert with a sigmoid
    gate beside the routed ones; windows on odd layers below max_window_layers when
    `use_sliding_window` (its config class's rule, where no layer_types are given)."""

    architecture = "qwen2_moe"
    hf_class_name = "Qwen2MoeForCausalLM"
    gguf_architecture = "qwen2moe"

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(super().from_hf(hf), attention_bias=bool(hf.get("qkv_bias", True)),
                    shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size")
                    or 0)

    def hf_sliding_windows(self, hf: dict[str, Any]) -> tuple[int | None, ...]:
        if hf.get("layer_types") or not hf.get("use_sliding_window", False):
            return super().hf_sliding_windows(hf)
        first_full = hf.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if (i + 1) % 2 and i < first_full
                       else "full_attention" for i in range(hf["num_hidden_layers"])]
        return super().hf_sliding_windows(dict(hf, layer_types=layer_types))

    def to_hf(self, config) -> dict[str, Any]:
        return dict(super().to_hf(config), qkv_bias=config.attention_bias,
                    shared_expert_intermediate_size=config.shared_expert_intermediate_size)


class Qwen3MoE(_QwenMoE):
    architecture = "qwen3_moe"
    hf_class_name = "Qwen3MoeForCausalLM"
    gguf_architecture = "qwen3moe"
    gguf_norm_topk_prob = True  # llama.cpp's qwen3moe graph renormalises
    attention_bias_by_default = False
    qk_norm = True


class Olmoe(FamilyRules):
    """OLMoE: RMSNorm over the whole query and key projections (not per head; the family's
    attention, not `qk_norm`), an optional clamp of Q, K and V, 64 experts top-8 not
    renormalised by default."""

    architecture = "olmoe"
    hf_class_name = "OlmoeForCausalLM"
    is_moe = True
    gguf_layer_names = _expert_names("mlp", "gate_proj", "up_proj", "down_proj")

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(super().from_hf(hf),
                    num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    clip_qkv=hf.get("clip_qkv"))

    def to_hf(self, config) -> dict[str, Any]:
        return dict(super().to_hf(config), num_experts=config.num_experts,
                    num_experts_per_tok=config.num_experts_per_tok,
                    norm_topk_prob=config.norm_topk_prob, clip_qkv=config.clip_qkv)

    def gguf_fields(self, meta: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        clamp = meta.get(f"{self.architecture}.attention.clamp_kqv")
        return {"qk_norm": False, "clip_qkv": None if clamp is None else float(clamp)}


class GptOss(FamilyRules):
    """gpt-oss: biases on Q/K/V and the output projection (`attention_bias`), learned attention
    sinks, sliding and full layers alternating (`layer_types`), YaRN; every layer a mixture of
    `num_local_experts` with a biased router whose top k are softmaxed (renormalised top-k),
    experts with biases and the clamped "swigluoai" activation."""

    architecture = "gpt_oss"
    hf_class_name = "GptOssForCausalLM"
    is_moe = True
    attention_bias_by_default = True
    window_pattern = 2  # sliding first (HF's default layer_types; llama.cpp's swa pattern)
    gguf_architecture = "gpt-oss"
    gguf_norm_topk_prob = True  # llama.cpp softmaxes the top k's logits
    gguf_layer_names = dict(_expert_names("mlp", "gate_proj", "up_proj", "down_proj"), **{
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_output.bias": "self_attn.o_proj.bias",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.bias": "mlp.gate.bias",
        "ffn_gate_exps.bias": "mlp.experts.{}.gate_proj.bias",
        "ffn_up_exps.bias": "mlp.experts.{}.up_proj.bias",
        "ffn_down_exps.bias": "mlp.experts.{}.down_proj.bias"})

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().from_hf(hf)
        return dict(fields, num_experts=hf["num_local_experts"],
                    num_experts_per_tok=hf.get("num_experts_per_tok",
                                               hf.get("experts_per_token")),
                    moe_intermediate_size=hf["intermediate_size"],
                    **self._gpt_oss_fields(fields["attention_bias"], hf))

    def gguf_fields(self, meta: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp's gpt-oss graph fixes rather than stores: the activation's constants
        (HF's defaults), sinks, biases; YaRN's ramp not truncated (GptOssConfig's)."""
        scaling = fields.get("rope_scaling")
        return dict(self._gpt_oss_fields(fields["attention_bias"], meta),
                    rope_scaling=None if scaling is None else dict(scaling, truncate=False))

    def _gpt_oss_fields(self, attention_bias: bool, hf: dict[str, Any]) -> dict[str, Any]:
        return {"norm_topk_prob": True, "hidden_act": "swigluoai",
                "attention_output_bias": attention_bias, "attention_sinks": True,
                "moe_router_bias": True, "moe_expert_bias": True,
                "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
                "swiglu_limit": float(hf.get("swiglu_limit", 7.0))}

    def to_hf(self, config) -> dict[str, Any]:
        return dict(super().to_hf(config), hidden_act="silu", hidden_activation="silu",
                    num_local_experts=config.num_experts,
                    num_experts_per_tok=config.num_experts_per_tok,
                    swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)


class DeepseekV3(FamilyRules):
    """DeepSeek-V3 / R1: multi-head latent attention (queries through q LoRA, each token's keys
    and values from one cached latent and one RoPE key every head shares; RoPE over interleaved
    pairs; YaRN, whose mscale_all_dim also scales the scores), the first
    `first_k_dense_replace` layers dense and the rest mixtures of `n_routed_experts` scored by a
    sigmoid, chosen with a correction bias among the experts of the `topk_group` best of
    `n_group` groups, renormalised and scaled by `routed_scaling_factor`, beside
    `n_shared_experts` ungated shared experts."""

    architecture = "deepseek_v3"
    hf_class_name = "DeepseekV3ForCausalLM"
    is_moe = True
    gguf_architecture = "deepseek2"  # V2 and V3 alike; the gating function tells them apart
    gguf_layer_names = dict(_expert_names("mlp", "gate_proj", "up_proj", "down_proj"), **{
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        # kv_b_proj split per head by the converter (W_UK transposed, W_UV): the family's
        # checkpoint_tensors joins them again
        "attn_k_b.weight": "self_attn.k_b_proj.weight",
        "attn_v_b.weight": "self_attn.v_b_proj.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"})

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().from_hf(hf)
        experts = hf.get("n_routed_experts", hf.get("num_local_experts")) or 0
        first_dense, every = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
        nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        return dict(
            fields, num_key_value_heads=hf["num_attention_heads"], head_dim=rope,
            partial_rotary_factor=1.0, q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=nope, v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)),
            attention_scale=(nope + rope) ** -0.5 * _yarn_all_dim_mscale(
                fields["rope_scaling"]) ** 2,
            num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0)
            * hf["moe_intermediate_size"],
            shared_expert_gated=False, moe_scoring="sigmoid", moe_correction_bias=True,
            moe_groups=hf.get("n_group") or 1, moe_topk_groups=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_layers=tuple(experts > 0 and i >= first_dense and i % (every or 1) == 0
                             for i in range(hf["num_hidden_layers"])),
            num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0))


    def gguf_fields(self, meta: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's deepseek2 keys (one converter for V2 and V3): MLA's ranks and widths,
        the gating function (2: sigmoid, V3's, with its correction bias), expert groups, the
        leading dense layers; the converter writes MLA as one KV head of the latent's width,
        which our config does not keep."""
        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"deepseek2.{name}", default)

        rope = int(key("rope.dimension_count"))
        sigmoid = int(key("expert_gating_func", 1)) == 2
        scaling = fields["rope_scaling"]
        if scaling and key("rope.scaling.yarn_log_multiplier"):  # 0.1 x mscale_all_dim
            mscale = float(key("rope.scaling.yarn_log_multiplier")) / 0.1
            scaling = dict(scaling, mscale=mscale, mscale_all_dim=mscale)
        nope = int(key("attention.key_length_mla")) - rope
        moe_width = int(key("expert_feed_forward_length"))
        return dict(
            architecture="deepseek_v3" if sigmoid else "deepseek_v2",
            num_key_value_heads=fields["num_attention_heads"], head_dim=rope,
            partial_rotary_factor=1.0, rope_scaling=scaling,
            q_lora_rank=int(key("attention.q_lora_rank", 0)),
            kv_lora_rank=int(key("attention.kv_lora_rank")), qk_nope_head_dim=nope,
            v_head_dim=int(key("attention.value_length_mla")), rope_interleave=True,
            attention_scale=(nope + rope) ** -0.5 * _yarn_all_dim_mscale(scaling) ** 2,
            moe_intermediate_size=moe_width,
            norm_topk_prob=bool(key("expert_weights_norm", False)),
            shared_expert_intermediate_size=int(key("expert_shared_count", 0)) * moe_width,
            shared_expert_gated=False, moe_scoring="sigmoid" if sigmoid else "softmax",
            moe_correction_bias=sigmoid, moe_groups=int(key("expert_group_count", 1)),
            moe_topk_groups=int(key("expert_group_used_count", 1)),
            routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
            moe_layers=tuple(i >= int(key("leading_dense_block_count", 0))
                             for i in range(fields["num_hidden_layers"])))


class DeepseekV2(DeepseekV3):
    """DeepSeek-V2 / V2-Lite: V3's attention (its complex RoPE rotates interleaved pairs, as
    V3's rope_interleave), router scores by softmax, "greedy" top-k or "group_limited_greedy"
    (groups rated by their best expert), never renormalised, no correction bias."""

    architecture = "deepseek_v2"
    hf_class_name = "DeepseekV2ForCausalLM"

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        if hf.get("mlp_bias"):
            raise UnsupportedArchitectureError("DeepSeek-V2 with MLP biases (mlp_bias) is not "
                                               "supported")
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedArchitectureError(f"DeepSeek-V2 routing {method!r} is not "
                                               "supported (greedy, group_limited_greedy are)")
        grouped = method == "group_limited_greedy"
        return dict(super().from_hf(hf), moe_scoring="softmax", moe_correction_bias=False,
                    norm_topk_prob=False, rope_interleave=True,
                    moe_groups=(hf.get("n_group") or 1) if grouped else 1,
                    moe_topk_groups=(hf.get("topk_group") or 1) if grouped else 1)


def _yarn_all_dim_mscale(scaling: dict[str, Any] | None) -> float:
    """YaRN's mscale at `mscale_all_dim` (DeepSeek's softmax scale takes its square: HF's
    yarn_apply_mscale); 1 without YaRN or that field."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    return 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0


BUILTIN_RULES = (Llama(), Mistral(), Phi3(), Qwen2(), Qwen3(), SmolLM3(), Gemma2(), Gemma3(),
                 Mixtral(), Qwen2MoE(), Qwen3MoE(), Olmoe(), GptOss(), DeepseekV3(), DeepseekV2())
