"""Write a random-weight HF Llama (or OLMoE, Qwen3-MoE, gpt-oss, DeepSeek-V2: mixtures of experts) checkpoint of a real shape,
for memory, start-up and speed benchmarks. Speed and memory depend on the shapes, not on what the weights learnt, and no trained
Llama weights can be downloaded here, so the weights are random (normal(0, 0.02) matrices, ones
for the norms) and the tokenizer is the bundled SmolLM2 one (49152 tokens, the vocabulary padded to
Llama 3's 128256 by convert_hf_to_gguf.py). The model is never built in memory: one tensor is
generated at a time into safetensors shards of about 2 GB (bfloat16), so the peak stays about one
shard even for the 8B (16 GB). Deterministic: tensor i comes from torch.Generator(seed + i).

Usage: make_random_llama.py SHAPE OUTDIR [--mtp-chain]
       (SHAPE: llama-3.2-1b | llama-3.2-3b | llama-3.1-8b | olmoe-1b-7b | qwen3-moe-6l |
               qwen3-moe-gqa-twin-3l | gpt-oss-4l | deepseek-v2-3l | deepseek-v3-3l-mtp)
Then: benchmarks/peers/llamacpp.sh convert OUTDIR x-bf16.gguf bf16
      benchmarks/peers/llamacpp.sh quantize x-bf16.gguf x-q4_k_m.gguf Q4_K_M"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
import transformers
from transformers import AutoTokenizer, GenerationConfig

# from the real configs; rope_scaling left out (plain RoPE: same shapes, same cost)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=False),
    # OLMoE-1B-7B-0924: 64 experts of 1024, 8 a token (6.9B parameters, 1.3B active)
    "olmoe-1b-7b": dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                        num_experts_per_tok=8, tie_word_embeddings=False, vocab_size=50304,
                        rope_theta=10000.0),
    # Qwen3-30B-A3B's layer (128 experts of 768, 8 a token, 32 query / 4 KV heads of 128,
    # QK-norm) for 6 of its 48 layers: 3.9B parameters, ~0.4B active, inside the 2-4B a
    # 2-core, 24 GiB machine converts and serves
    "qwen3-moe-6l": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=6,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                         norm_topk_prob=True, tie_word_embeddings=False, vocab_size=49152,
                         rope_theta=1000000.0, rms_norm_eps=1e-6),
    # deepseek-v2-3l's twin with grouped-query attention instead of latent attention (16 query
    # heads, 8 KV heads of 128: 4,096 KV bytes a token and layer in bf16 against MLA's 1,152),
    # its experts (64 of 1408, 6 a token) in every layer, no shared expert: for
    # benchmarks/mla_concurrency.py, where only the cache differs in what it measures
    "qwen3-moe-gqa-twin-3l": dict(hidden_size=2048, intermediate_size=10944,
                                  num_hidden_layers=3, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=128, num_experts=64,
                                  num_experts_per_tok=6, moe_intermediate_size=1408,
                                  norm_topk_prob=False, tie_word_embeddings=False,
                                  vocab_size=49152, rope_theta=10000.0, rms_norm_eps=1e-6),
    # gpt-oss-20b's layer (32 experts of 2880, 4 a token, 64 query / 8 KV heads of 64, sinks,
    # biases, a 128-token window on every other layer) for 4 of its 24 layers: 3.6B parameters
    "gpt-oss-4l": dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                       num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                       layer_types=["sliding_attention", "full_attention"] * 2,
                       tie_word_embeddings=False, vocab_size=49152, attention_bias=True,
                       rope_theta=150000.0, rms_norm_eps=1e-5),
    # DeepSeek-V2-Lite's layers (latent attention: kv_lora_rank 512, 16 heads of 128 + 64 RoPE
    # dims; 64 experts of 1408, 6 a token, 2 shared; the first layer dense; YaRN) with V2's q
    # LoRA of 1536 (llama.cpp requires q_lora_rank unless a file has V2-Lite's 26 or 27 layers)
    # for 3 layers: 1.46B parameters, within the 1-2B issue 56 asks for
    "deepseek-v2-3l": dict(hidden_size=2048, intermediate_size=10944, num_hidden_layers=3,
                                num_attention_heads=16, num_key_value_heads=16,
                                kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                                num_experts_per_tok=6, moe_intermediate_size=1408,
                                n_shared_experts=2, first_k_dense_replace=1,
                                topk_method="greedy", routed_scaling_factor=1.0,
                                vocab_size=49152, max_position_embeddings=163840,
                                rms_norm_eps=1e-6, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                 "factor": 40.0, "beta_fast": 32,
                                                 "beta_slow": 1, "mscale": 0.707,
                                                 "mscale_all_dim": 0.707,
                                                 "original_max_position_embeddings": 4096}),
}
# the same model as DeepSeek-V3 runs it (sigmoid routing with the correction bias over 8 groups
# of 8 experts, the best 4 kept, renormalised and scaled) with V3's one MTP module after the 3
# layers (an MoE layer, its own embedding and head): 2.0B parameters
SHAPES["deepseek-v3-3l-mtp"] = dict(
    SHAPES["deepseek-v2-3l"], topk_method="noaux_tc", n_group=8, topk_group=4,
    norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1)
# (config class, architecture) of the mixtures of experts; the rest are Llamas
MOE_FAMILIES = {"olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
                "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                "gpt-oss": ("GptOssConfig", "GptOssForCausalLM"),
                "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
                "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
COMMON = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
              rope_theta=500000.0, hidden_act="silu", attention_bias=False, mlp_bias=False)
TOKENIZER_MODEL = "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
SHARD_BYTES = 2 * 1024**3
CHUNK = 1 << 24  # elements generated in float32 at a time


def tensor_plan(cfg) -> list[tuple[str, tuple[int, ...]]]:
    if cfg.model_type == "gpt_oss":
        return gpt_oss_plan(cfg)
    if cfg.model_type in ("deepseek_v2", "deepseek_v3"):
        return deepseek_v2_plan(cfg)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    experts = getattr(cfg, "num_experts", 0)
    expert_width = getattr(cfg, "moe_intermediate_size", None) or i
    head_norm = (head_dim,) if cfg.model_type == "qwen3_moe" else None  # per head, not whole
    plan = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        plan += [(p + "input_layernorm.weight", (h,)),
                 (p + "self_attn.q_proj.weight", (q, h)),
                 (p + "self_attn.k_proj.weight", (kv, h)),
                 (p + "self_attn.v_proj.weight", (kv, h)),
                 (p + "self_attn.o_proj.weight", (h, q)),
                 (p + "post_attention_layernorm.weight", (h,))]
        if experts:  # QK-norm (OLMoE's over whole projections), the router, each expert
            plan += [(p + "self_attn.q_norm.weight", head_norm or (q,)),
                     (p + "self_attn.k_norm.weight", head_norm or (kv,)),
                     (p + "mlp.gate.weight", (experts, h))]
            mlps = [f"{p}mlp.experts.{e}." for e in range(experts)]
            width = expert_width
        else:
            mlps, width = [p + "mlp."], i
        for mlp in mlps:
            plan += [(mlp + "gate_proj.weight", (width, h)), (mlp + "up_proj.weight", (width, h)),
                     (mlp + "down_proj.weight", (h, width))]
    plan.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        plan.append(("lm_head.weight", (v, h)))
    return plan


def gpt_oss_plan(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """gpt-oss's checkpoint layout: biases, sinks, the router, each layer's experts stacked
    ([E, in, out], gate and up interleaved)."""
    h, i, v, e = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_local_experts
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    plan = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h),
                                 ("o_proj", h, q)):
            plan += [(f"{p}self_attn.{name}.weight", (rows, cols)),
                     (f"{p}self_attn.{name}.bias", (rows,))]
        plan += [(p + "input_layernorm.weight", (h,)),
                 (p + "self_attn.sinks", (cfg.num_attention_heads,)),
                 (p + "post_attention_layernorm.weight", (h,)),
                 (p + "mlp.router.weight", (e, h)), (p + "mlp.router.bias", (e,)),
                 (p + "mlp.experts.gate_up_proj", (e, h, 2 * i)),
                 (p + "mlp.experts.gate_up_proj_bias", (e, 2 * i)),
                 (p + "mlp.experts.down_proj", (e, i, h)),
                 (p + "mlp.experts.down_proj_bias", (e, h))]
    plan += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return plan


def deepseek_v2_plan(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSeek-V2's checkpoint layout: latent attention's projections and norms (q LoRA's
    where the config has it), the first `first_k_dense_replace` layers' dense MLP, then the
    router, each expert and the shared experts."""
    h, v, heads = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    nope, rope, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    plan = [("model.embed_tokens.weight", (v, h))]
    modules = getattr(cfg, "num_nextn_predict_layers", 0) if cfg.model_type == "deepseek_v3" \
        else 0
    for n in range(cfg.num_hidden_layers + modules):
        p = f"model.layers.{n}."
        if n >= cfg.num_hidden_layers:  # V3's MTP module: its own embedding, norms and head
            plan += [(p + "embed_tokens.weight", (v, h)), (p + "enorm.weight", (h,)),
                     (p + "hnorm.weight", (h,)), (p + "eh_proj.weight", (h, 2 * h)),
                     (p + "shared_head.norm.weight", (h,)),
                     (p + "shared_head.head.weight", (v, h))]
        plan.append((p + "input_layernorm.weight", (h,)))
        if cfg.q_lora_rank:
            plan += [(p + "self_attn.q_a_proj.weight", (cfg.q_lora_rank, h)),
                     (p + "self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,)),
                     (p + "self_attn.q_b_proj.weight", (heads * (nope + rope), cfg.q_lora_rank))]
        else:
            plan.append((p + "self_attn.q_proj.weight", (heads * (nope + rope), h)))
        plan += [(p + "self_attn.kv_a_proj_with_mqa.weight", (rank + rope, h)),
                 (p + "self_attn.kv_a_layernorm.weight", (rank,)),
                 (p + "self_attn.kv_b_proj.weight", (heads * (nope + cfg.v_head_dim), rank)),
                 (p + "self_attn.o_proj.weight", (h, heads * cfg.v_head_dim)),
                 (p + "post_attention_layernorm.weight", (h,))]
        if n < cfg.first_k_dense_replace:
            mlps = [(p + "mlp.", cfg.intermediate_size)]
        else:
            plan.append((p + "mlp.gate.weight", (cfg.n_routed_experts, h)))
            if cfg.model_type == "deepseek_v3":
                plan.append((p + "mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,)))
            mlps = [(f"{p}mlp.experts.{e}.", cfg.moe_intermediate_size)
                    for e in range(cfg.n_routed_experts)]
            mlps.append((p + "mlp.shared_experts.",
                         cfg.moe_intermediate_size * cfg.n_shared_experts))
        for mlp, width in mlps:
            plan += [(mlp + "gate_proj.weight", (width, h)), (mlp + "up_proj.weight", (width, h)),
                     (mlp + "down_proj.weight", (h, width))]
    plan += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return plan


def random_tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    if len(shape) == 1:  # RMSNorm weights
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(-1)
    for start in range(0, flat.numel(), CHUNK):  # bounded float32 scratch
        n = min(CHUNK, flat.numel() - start)
        flat[start:start + n] = torch.randn(n, generator=gen).mul_(0.02)
    return out


def make_tensor(name: str, shape: tuple[int, ...], seed: int, args, seeds: dict[str, int]):
    """A tensor of the plan: random, or (--mtp-chain) the rig's."""
    if not args.mtp_chain:
        return random_tensor(shape, seed)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if name.endswith("eh_proj.weight"):  # [embedding | hidden] -> the embedding
        hidden = shape[0]
        return torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1).bfloat16()
    if name.endswith(".embed_tokens.weight"):
        return random_tensor(shape, seeds["model.embed_tokens.weight"])
    if name.endswith("shared_head.head.weight"):
        return random_tensor(shape, seeds["lm_head.weight"])
    return random_tensor(shape, seed)


def write_tokenizer(out: Path) -> dict[str, int]:
    """Copy the SmolLM2 tokenizer files; the bundled model is a GGUF, so when there are no HF
    files next to it the tokenizer is rebuilt from the GGUF by transformers and saved."""
    from kvserve.model_source import resolve_model
    path = Path(resolve_model(TOKENIZER_MODEL).path)
    src = path if path.is_dir() else path.parent
    if (src / "tokenizer.json").exists():
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)
        tokenizer = AutoTokenizer.from_pretrained(str(out))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=path.name)
        tokenizer.save_pretrained(str(out))
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp-chain", action="store_true", help=(
        "(deepseek-v3-3l-mtp) every attention output and MLP down projection zero, and the MTP "
        "module passing the next token's embedding to the target's own head: the module then "
        "predicts exactly the target's next token, so MTP drafts are all but always accepted "
        "(a rig for the speed of drafting and verifying at this size, never for quality)"))
    args = parser.parse_args()
    out: Path = args.outdir
    out.mkdir(parents=True, exist_ok=True)

    special = write_tokenizer(out)
    family = next((f for f in MOE_FAMILIES if args.shape.startswith(f)), None)
    config_name, architecture = MOE_FAMILIES.get(family, ("LlamaConfig", "LlamaForCausalLM"))
    config_class = getattr(transformers, config_name)
    cfg = config_class(**{**COMMON, **SHAPES[args.shape], **special}, dtype="bfloat16")
    cfg.architectures = [architecture]
    cfg.save_pretrained(str(out))
    if not (out / "generation_config.json").exists():
        GenerationConfig(**special).save_pretrained(str(out))

    plan = tensor_plan(cfg)
    seeds = {name: args.seed + idx for idx, (name, _) in enumerate(plan)}
    shards: list[list[tuple[int, str, tuple[int, ...]]]] = [[]]
    size = 0
    for idx, (name, shape) in enumerate(plan):
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((idx, name, shape))
        size += nbytes

    weight_map, total = {}, 0
    for s, shard in enumerate(shards, 1):
        fname = f"model-{s:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: make_tensor(name, shape, args.seed + idx, args, seeds)
                   for idx, name, shape in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
        print(f"{fname}: {len(shard)} tensors", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    n_params = total // 2
    print(f"{args.shape}: {n_params / 1e9:.2f}B parameters, {total / 1e9:.2f} GB in {len(shards)} "
          f"shards -> {out}")


if __name__ == "__main__":
    main()
