"""What a model costs per token and holds in memory, for the planner: the roofline's ModelCost
(kvserve.bench.roofline) extended to the shapes we plan but cannot run here: MLA attention
(DeepSeek's latent KV), every expert of a mixture held in memory, sliding windows, and the
attention products that grow with the context. A dense GQA model's figures equal the
roofline's model_cost (tests/test_plan.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.bench import roofline
from kvserve.config import ModelConfig

# bytes per cached value of each KV dtype; int8/fp8 rows carry a float32 scale per row (per
# token and head, or per token's latent row under MLA): kvserve's layout (68 bytes a row of 64)
KV_DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0}


@dataclass(frozen=True)
class PlanCost:
    """A model in one weight and KV format. Weight bytes are what one token's decode step
    reads (top-k experts) and what memory must hold (all experts) apart."""
    cost: roofline.ModelCost  # the roofline's: flops and bytes one token reads
    resident_weight_bytes: float  # every weight, embeddings and LM head included
    expert_bytes_per_layer: float  # one routed expert's weights (0: dense)
    moe_layers: int
    kv_bytes_per_token_layer: tuple[float, ...]  # per layer, at the KV dtype
    windows: tuple[int | None, ...]  # per layer's sliding window (None: full attention)

    def kv_bytes_per_sequence(self, context: int) -> float:
        """KV one sequence of `context` tokens holds: sliding layers keep only their window."""
        return sum(per_token * (min(context, window) if window else context)
                   for per_token, window in zip(self.kv_bytes_per_token_layer, self.windows))


def kv_value_bytes(kv_dtype: str, row_values: int) -> float:
    """Bytes per cached value: the dtype's width, or a byte plus the row's float32 scale."""
    if kv_dtype in KV_DTYPE_BYTES:
        return KV_DTYPE_BYTES[kv_dtype]
    if kv_dtype in ("int8", "fp8"):
        return 1.0 + 4.0 / row_values
    raise ValueError(f"unknown KV dtype {kv_dtype!r} (float32, bfloat16, int8, fp8)")


def attention_params(config: ModelConfig) -> int:
    """One layer's attention projections. MLA (kv_lora_rank > 0): queries through q LoRA (or a
    plain q_proj), the shared latent plus RoPE key (kv_a), the latent's expansion to each head's
    keys and values (kv_b), and the output; else q, k, v and o."""
    hidden = config.hidden_size
    if not config.kv_lora_rank:
        return hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden
    heads, rope = config.num_attention_heads, config.head_dim
    q_out = heads * (config.qk_nope_head_dim + rope)
    query = (hidden * config.q_lora_rank + config.q_lora_rank * q_out) if config.q_lora_rank \
        else hidden * q_out
    kv_a = hidden * (config.kv_lora_rank + rope)
    kv_b = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    return query + kv_a + kv_b + heads * config.v_head_dim * hidden


def kv_row_values(config: ModelConfig) -> tuple[int, int]:
    """(rows, values per row) one token caches per layer: K and V of each KV head, or MLA's
    single latent-plus-RoPE-key row (all DeepSeek's cache keeps)."""
    if config.kv_lora_rank:
        return 1, config.kv_lora_rank + config.head_dim
    return 2 * config.num_key_value_heads, config.head_dim


def _mlp_params(config: ModelConfig, layer: int, experts: int) -> int:
    """A layer's MLP with `experts` of its routed experts (dense layers: the whole MLP)."""
    hidden = config.hidden_size
    if not config.is_moe_layer(layer):
        return 3 * hidden * config.intermediate_size
    shared = config.shared_expert_intermediate_size
    return (hidden * config.num_experts + 3 * hidden * config.moe_intermediate_size * experts
            + (3 * hidden * shared + hidden if shared else 0))


def plan_cost(config: ModelConfig, fmt: roofline.WeightFormat, kv_dtype: str) -> PlanCost:
    """The model's per-token cost and footprint in a weight format and KV dtype."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    attention = attention_params(config)
    read = sum(attention + _mlp_params(config, layer, config.num_experts_per_tok)
               for layer in range(layers))
    held = sum(attention + _mlp_params(config, layer, config.num_experts)
               for layer in range(layers))
    head = hidden * config.vocab_size
    rows, row_values = kv_row_values(config)
    per_layer = rows * row_values * kv_value_bytes(kv_dtype, row_values)
    cost = roofline.ModelCost(
        layer_flops_per_token=2.0 * read, lm_head_flops_per_token=2.0 * head,
        weight_bytes=read * fmt.layer_bytes_per_weight + head * fmt.head_bytes_per_weight,
        kv_bytes_per_token=per_layer * layers)
    embeddings = 0 if config.tie_word_embeddings else head * fmt.head_bytes_per_weight
    return PlanCost(
        cost=cost,
        resident_weight_bytes=held * fmt.layer_bytes_per_weight
        + head * fmt.head_bytes_per_weight + embeddings,
        expert_bytes_per_layer=3 * hidden * config.moe_intermediate_size
        * fmt.layer_bytes_per_weight if config.num_experts else 0.0,
        moe_layers=sum(config.is_moe_layer(layer) for layer in range(layers)),
        kv_bytes_per_token_layer=(per_layer,) * layers,
        windows=tuple(config.sliding_window(layer) for layer in range(layers)))


def attention_flops_per_token(config: ModelConfig, context: int) -> float:
    """Score and value products of one token over `context` earlier tokens in every layer
    (sliding layers over their window): 2 x heads x (key + value dims) x context; MLA in its
    absorbed form (keys of kv_lora_rank + RoPE dims, values of kv_lora_rank)."""
    heads = config.num_attention_heads
    dims = (2 * config.kv_lora_rank + config.head_dim) if config.kv_lora_rank \
        else 2 * config.head_dim
    return sum(2.0 * heads * dims * (min(context, window) if window else context)
               for window in (config.sliding_window(layer)
                              for layer in range(config.num_hidden_layers)))


def expected_experts_touched(config: ModelConfig, tokens: float) -> float:
    """Routed experts a step of `tokens` tokens reads per MoE layer, for uniform routing:
    E x (1 - (1 - k/E)^tokens); 1 token reads k, a large batch all E."""
    if not config.num_experts:
        return 0.0
    experts, top_k = config.num_experts, config.num_experts_per_tok
    return experts * (1.0 - (1.0 - top_k / experts) ** max(tokens, 1.0))
