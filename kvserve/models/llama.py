"""The decoder families on one set of layers (Llama 2/3, SmolLM 2/3, Mistral, Qwen2, Qwen3,
Gemma 2/3, Phi-3 / Phi-4-mini) over one flattened ragged batch. A family is a set of ModelConfig
options, read from its HF config or GGUF metadata (kvserve/config.py, kvserve/weights/
gguf_file.py): QK-norm, Gemma's (1 + w) norms around both attention and MLP, GeGLU, a scaled
embedding, a per-layer RoPE table (Gemma 3's local and global bases, SmolLM3's RoPE-less layers),
logit soft-capping, RoPE scalings (linear, Llama 3, YaRN, LongRoPE) and partial rotary (Phi-4-mini:
Q/K rows reordered at load so the full-width rotation is the partial one, `rotary_head_order`).

`forward(input_ids[T], positions[T], attn_metadata) -> hidden[T, H]`: no padding, no notion of
requests. Q/K/V and gate/up projections are fused into single GEMMs; `load_weights` slices the
HF-named checkpoint tensors into them. Each attention layer reads and writes its own slice of the
paged KV cache, bound once by the runner with `bind_kv_cache`. A layer with a sliding window
(Mistral, Qwen2's upper layers; `ModelConfig.sliding_windows`) passes it to the backend on each
call; a backend that cannot apply windows is refused when the model is built.

Given a ParallelContext with tp_size > 1 the model is one tensor-parallel rank's shard: its
config is the rank's (kvserve/distributed/sharding.py), o_proj and down_proj outputs are partial
sums all-reduced in place, the embedding and LM head hold a vocabulary range. With tp_size 1 the
context is dropped (`self.tp` None) and nothing extra runs.

A KV connector that moves KV layer by layer is bound with `bind_kv_connector`: each stage
layer i then calls its `wait_for_layer_load(i)` before running and `save_kv_layer(i, cache,
metadata)` after (without one, `self.kv_connector` is None and nothing extra runs).

Given pp_size > 1 the model is one pipeline stage: it builds only its decoder layers (the
others are parameterless `PPMissingLayer`s, so parameter names keep their global layer index),
the embedding on the first stage, the final norm and LM head on the last. A stage other than
the first starts from the previous stage's `IntermediateTensors`; one other than the last
returns its own instead of hidden states.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.attention.paged import plan_step
from kvserve.config import FUSED_CHECKPOINT_ARCHITECTURES, ModelConfig
from kvserve.distributed.communication import gather_vocab
from kvserve.distributed.parallel_state import ParallelContext, active, stage_of
from kvserve.distributed.sharding import stage_layer_counts, stage_layer_range, vocab_range
from kvserve.errors import UnsupportedArchitectureError
from kvserve.kernels.reference import gelu_tanh_and_mul
from kvserve.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    rotary_head_order,
    rotate_cached_keys,
)
from kvserve.models.vocab_parallel import VocabParallelEmbedding


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: the hidden states and, on the fused path, the
    residual stream kept beside them (None on the eager path, where hidden includes it)."""

    hidden: torch.Tensor
    residual: torch.Tensor | None = None

    def pack(self) -> torch.Tensor:
        """One contiguous tensor [1 or 2, tokens, hidden] for one send."""
        if self.residual is None:
            return self.hidden.unsqueeze(0).contiguous()
        return torch.stack((self.hidden, self.residual))

    @staticmethod
    def unpack(packed: torch.Tensor) -> "IntermediateTensors":
        return IntermediateTensors(packed[0], packed[1] if packed.shape[0] == 2 else None)


class PPMissingLayer(nn.Module):
    """Stands where another pipeline stage holds a module: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 parallel: ParallelContext | None = None, layer_index: int = 0):
        super().__init__()
        self.tp = active(parallel)
        self.sliding_window = config.sliding_window(layer_index) or 0  # 0: full attention
        self.rope_kind = config.layer_rope(layer_index)  # which RoPE table (LlamaModel.rotaries)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.scale
        self.softcap = config.attn_logit_softcapping or 0.0  # Gemma 2's score capping
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        # QK-norm (Qwen3, Gemma 3): each query and key head RMS-normalised before RoPE
        offset = config.norm_weight_offset
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset) if config.qk_norm \
            else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset) if config.qk_norm \
            else None
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0  # its KV cache group (the hybrid layout): whose block tables it reads

    def forward(self, rotary, hidden, metadata: AttentionMetadata) -> torch.Tensor:
        metadata = metadata.for_group(self.kv_group)
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(-1, self.num_heads, self.head_dim)
        key = key.view(-1, self.num_kv_heads, self.head_dim)
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = apply_rotary(query, key, rotary)
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: call model.bind_kv_cache(...) first")
        attended = self.backend.forward(query, key, value, self.kv_cache, metadata, self.scale,
                                        self.sliding_window, self.softcap)
        out = self.o_proj(attended.reshape(-1, self.q_size))
        if self.tp is not None:
            self.tp.communicator.all_reduce_(out)
        return out

    def forward_fused(self, hidden, positions, cos_sin, metadata) -> torch.Tensor:
        """The `paged` path: RoPE and the cache write in one op on the fused QKV output, then
        attention over the blocks in place."""
        metadata = metadata.for_group(self.kv_group)
        # projections called through .forward: nn.Module.__call__ costs ~1 us of hook checks,
        # ~120 times per step (the fused path never uses hooks)
        qkv = self.qkv_proj.forward(hidden)
        if self.q_norm is not None:
            self._norm_heads_in_place(qkv)
        ops = self.backend.ops
        ops.rope_and_cache_(qkv, positions, cos_sin, self.kv_cache, metadata.slot_mapping,
                            self.num_heads, self.num_kv_heads, self.head_dim)
        attended = self.backend.attend(qkv, self.kv_cache, metadata, self.num_heads,
                                       self.num_kv_heads, self.head_dim, self.scale,
                                       self.sliding_window, self.softcap)
        out = self.o_proj.forward(attended)
        if self.tp is not None:
            self.tp.communicator.all_reduce_(out)
        return out

    def _norm_heads_in_place(self, qkv: torch.Tensor) -> None:
        """QK-norm on the fused QKV rows, before the fused RoPE + cache write: the query and
        key heads replaced by their normalised values (the same ops as the eager path)."""
        tokens = qkv.shape[0]
        query = qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim)
        key = qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads,
                                                                  self.head_dim)
        query.copy_(self.q_norm(query))
        key.copy_(self.k_norm(key))


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh GELU (Gemma's GeGLU)."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext | None = None):
        super().__init__()
        self.tp = active(parallel)
        self.intermediate_size = config.intermediate_size
        self.hidden_act = config.hidden_act
        self.act = _ACTIVATIONS[config.hidden_act]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        out = self.down_proj(self.act(gate) * up)
        if self.tp is not None:
            self.tp.communicator.all_reduce_(out)
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual blocks. With `sandwich_norms` (Gemma) post_attention_layernorm
    normalises attention's output, and pre_/post_feedforward_layernorm wrap the MLP."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 parallel: ParallelContext | None = None, layer_index: int = 0):
        super().__init__()
        norm = partial(RMSNorm, config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(config, backend, parallel, layer_index)
        self.post_attention_layernorm = norm()
        self.sandwich_norms = config.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = LlamaMLP(config, parallel)

    def forward(self, rotary, hidden, metadata):
        attended = self.self_attn(rotary, self.input_layernorm(hidden), metadata)
        if not self.sandwich_norms:
            hidden = hidden + attended
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 parallel: ParallelContext | None = None):
        super().__init__()
        check_sliding_window_support(config, backend)
        check_softcap_support(config, backend)
        pp_rank, pp_size = stage_of(parallel)
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        counts = (parallel.layer_partition if parallel is not None and parallel.layer_partition
                  else stage_layer_counts(config, pp_size))
        self.start_layer, self.end_layer = stage_layer_range(list(counts), pp_rank)
        # the last stage keeps the embedding too when the LM head is tied to it
        self.holds_embedding = self.is_first_stage or (self.is_last_stage
                                                       and config.tie_word_embeddings)
        if not self.holds_embedding:
            self.embed_tokens = PPMissingLayer()
        elif active(parallel) is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                       parallel)
        self.embedding_multiplier = config.embedding_multiplier
        self.rotary_emb = RotaryEmbedding(config)  # the global table: every layer's but these
        kinds = {config.layer_rope(i) for i in range(self.start_layer, self.end_layer)}
        self.local_rotary_emb = RotaryEmbedding(config, "local") if "local" in kinds else None
        self.no_rotary_emb = RotaryEmbedding(config, "none") if "none" in kinds else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, parallel, i)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.stage_layers = [self.layers[i] for i in range(self.start_layer, self.end_layer)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset) \
            if self.is_last_stage else PPMissingLayer()
        # the fused layer ops of a `paged` backend (shared by every layer), else None: eager path
        self.ops = getattr(backend, "ops", None)
        self.kv_connector = None  # a layer-wise KV connector's hooks (worker side), if bound
        # The decoder layers as one C++ call for decode steps (models/decode_stack.py), built on
        # the first step that can use it; `enforce_eager` (--enforce-eager) keeps Python's loop.
        self.enforce_eager = False
        self._decode_stack: object | None | bool = None  # False: does not apply to this model

    def forward(self, input_ids, positions, metadata,
                intermediate: IntermediateTensors | None = None):
        """Hidden states [T, H] on the last stage; the stage's IntermediateTensors elsewhere.
        `intermediate`: the previous stage's (every stage but the first)."""
        if self.ops is not None:
            return self._forward_fused(input_ids, positions, metadata, intermediate)
        hidden = self.embed(input_ids) if intermediate is None else intermediate.hidden
        rotaries = {kind: table(positions, hidden.dtype) for kind, table in self.rotaries.items()}
        hooks = self.kv_connector
        for i, layer in enumerate(self.stage_layers):
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            hidden = layer(rotaries[layer.self_attn.rope_kind], hidden, metadata)
            if hooks is not None:
                hooks.save_kv_layer(i, layer.self_attn.kv_cache, metadata)
        if not self.is_last_stage:
            return IntermediateTensors(hidden)
        return self.norm(hidden)

    @property
    def rotaries(self) -> dict[str, RotaryEmbedding]:
        """The RoPE tables this stage's layers use, by kind (`ModelConfig.layer_rope`)."""
        tables = {"global": self.rotary_emb}
        if self.local_rotary_emb is not None:
            tables["local"] = self.local_rotary_emb
        if self.no_rotary_emb is not None:
            tables["none"] = self.no_rotary_emb
        return tables

    def reset_rotary_tables(self) -> None:
        """Recompute every RoPE table in float32 (after loading, casting or moving)."""
        device = self.rotary_emb.freq_factors.device
        for table in self.rotaries.values():
            table.float().reset_tables(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, times Gemma's sqrt(hidden) in their dtype (as HF rounds it)."""
        hidden = self.embed_tokens.forward(input_ids)
        if self.embedding_multiplier is None:
            return hidden
        return hidden * torch.tensor(self.embedding_multiplier).to(hidden.dtype)

    def _forward_fused(self, input_ids, positions, metadata,
                       intermediate: IntermediateTensors | None = None):
        """Same maths as the eager path with ~9 calls per layer: the residual stream is kept
        separately and each "add, then RMSNorm" is one in-place op (as vLLM's fused_add_rms_norm)."""
        ops = self.ops
        stack = self._stack_for(metadata, intermediate)
        if stack is not None:
            plan = metadata.plan
            return stack.run(self.embed(input_ids), positions,
                             self.rotary_emb.cos_sin, metadata.slot_mapping, plan.paged_seq_ids,
                             plan.flash_seq_ids, plan.query_start_loc, metadata.seq_lens,
                             metadata.block_tables)
        if intermediate is None:
            residual, hidden = self.embed(input_ids), None
        else:
            residual, hidden = intermediate.residual, intermediate.hidden
        tables = {kind: table.cos_sin for kind, table in self.rotaries.items()}
        hooks = self.kv_connector
        for i, layer in enumerate(self.stage_layers):
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            norm = layer.input_layernorm
            if hidden is None:
                hidden = ops.rms_norm(residual, norm.weight, norm.eps, norm.weight_offset)
            else:
                ops.add_rms_norm_(hidden, residual, norm.weight, norm.eps, norm.weight_offset)
            attention = layer.self_attn
            hidden = attention.forward_fused(hidden, positions, tables[attention.rope_kind],
                                             metadata)
            if hooks is not None:
                hooks.save_kv_layer(i, attention.kv_cache, metadata)
            hidden = self._mlp_fused(layer, hidden, residual)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual)
        norm = self.norm
        ops.add_rms_norm_(hidden, residual, norm.weight, norm.eps, norm.weight_offset)
        return hidden

    def _mlp_fused(self, layer: LlamaDecoderLayer, attended: torch.Tensor,
                   residual: torch.Tensor) -> torch.Tensor:
        """residual += (normed) attention output, then the MLP on the normed residual: its
        output (normed, with sandwich norms) is the next add's."""
        ops = self.ops
        if layer.sandwich_norms:
            norm = layer.post_attention_layernorm
            attended = ops.rms_norm(attended, norm.weight, norm.eps, norm.weight_offset)
            norm = layer.pre_feedforward_layernorm
        else:
            norm = layer.post_attention_layernorm
        ops.add_rms_norm_(attended, residual, norm.weight, norm.eps, norm.weight_offset)
        mlp = layer.mlp
        gate_up = mlp.gate_up_proj.forward(attended)
        activated = ops.silu_and_mul(gate_up) if mlp.hidden_act == "silu" \
            else gelu_tanh_and_mul(gate_up)
        hidden = mlp.down_proj.forward(activated)
        if mlp.tp is not None:
            mlp.tp.communicator.all_reduce_(hidden)
        if layer.sandwich_norms:
            norm = layer.post_feedforward_layernorm
            hidden = ops.rms_norm(hidden, norm.weight, norm.eps, norm.weight_offset)
        return hidden

    def _stack_for(self, metadata, intermediate):
        """The decode stack when this step can take it: built once (on the whole model only),
        and every sequence of the step on the paged kernel or, over a bf16 cache, the flash
        kernel (plans the step if needed; the Python path reuses the plan)."""
        if self.enforce_eager or self._decode_stack is False or intermediate is not None \
                or self.kv_connector is not None or metadata.group_metadata:
            return None
        if self._decode_stack is None:
            from kvserve.models.decode_stack import build_decode_stack

            self._decode_stack = build_decode_stack(self) or False
            # whether PagedBackend.attend plans flash rows (the Python path reuses our plan),
            # and whether the stack can run them (an int8 cache is dequantized for flash)
            attention = self.stage_layers[0].self_attn
            self._stack_plans_flash = self.embed_tokens.weight.dtype == torch.bfloat16 and \
                self.ops.flash_attention_supported(attention.head_dim)
            self._stack_runs_flash = self._stack_plans_flash and \
                attention.kv_cache.dtype == torch.bfloat16
        if self._decode_stack is False:
            return None
        plan = metadata.plan or plan_step(metadata, self._stack_plans_flash)
        if plan.fresh or plan.gathered or \
                (plan.flash_seq_ids.numel() and not self._stack_runs_flash):
            return None
        return self._decode_stack

    def reset_decode_stack(self) -> None:
        """Forget the stack (new KV tensors, changed layers): the next step builds it again."""
        self._decode_stack = None


def check_sliding_window_support(config: ModelConfig, backend: AttentionBackend) -> None:
    """Refuse, at load, a backend that would attend past a windowed layer's window (every token
    after the window would then be wrong)."""
    windowed = [i for i in range(config.num_hidden_layers) if config.sliding_window(i)]
    if windowed and not getattr(backend, "supports_sliding_window", False):
        raise UnsupportedArchitectureError(
            f"this {config.architecture} model uses sliding-window attention on {len(windowed)} "
            f"of its {config.num_hidden_layers} layers (window "
            f"{config.sliding_window(windowed[0])}), which the attention backend "
            f"{getattr(backend, 'name', type(backend).__name__)!r} cannot apply; use the "
            "'paged', 'torch_ref' or 'sdpa_batched' backend")


def check_softcap_support(config: ModelConfig, backend: AttentionBackend) -> None:
    """Refuse, at load, attention logit soft-capping (Gemma 2) on a backend without it."""
    cap = config.attn_logit_softcapping
    if cap and not getattr(backend, "supports_softcap", False):
        raise UnsupportedArchitectureError(
            f"this {config.architecture} model soft-caps attention scores ({cap}), which the "
            f"attention backend {getattr(backend, 'name', type(backend).__name__)!r} cannot do")


# HF checkpoint name fragment -> (our fused parameter fragment, shard index)
_FUSED_SHARDS = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 parallel: ParallelContext | None = None):
        """`config` is the rank's shard config when `parallel` spans several ranks."""
        super().__init__()
        tp_size = parallel.tp_size if parallel is not None else 1
        if tp_size != config.tensor_parallel_size:
            raise ValueError(f"config is for tensor-parallel size {config.tensor_parallel_size}, "
                             f"the context for {tp_size}: pass shard_config(config, tp_size)")
        self.config = config
        self.parallel = active(parallel)
        self.model = LlamaModel(config, backend, parallel)
        self.has_lm_head = self.model.is_last_stage
        if config.tie_word_embeddings or not self.has_lm_head:
            self.lm_head = None
        else:
            rows = config.vocab_size if self.parallel is None else vocab_range(
                config.vocab_size, parallel.tp_size, parallel.tp_rank)[2]  # the rank's range
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.logits_head: nn.Module | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None):
        return self.model(input_ids, positions, metadata, intermediate)

    @property
    def num_stage_layers(self) -> int:
        """Decoder layers this stage runs (and holds KV for)."""
        return len(self.model.stage_layers)

    def holds(self, name: str) -> bool:
        """Whether this stage has a place for the checkpoint tensor `name` (HF or fused name):
        false for other stages' layers, the embedding, final norm and LM head where absent."""
        model = self.model
        match = _LAYER_INDEX.match(name)
        if match:
            return model.start_layer <= int(match[1]) < model.end_layer
        if name.startswith("model.embed_tokens."):
            return model.holds_embedding
        if name.startswith(("model.norm.", "lm_head.")):
            return model.is_last_stage
        return True

    @property
    def kernel_ops(self):
        """The op set (compiled or torch) the model's layers run, or None on the eager paths."""
        return self.model.ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for just the rows given: callers pass only sampled positions (with
        tensor parallelism each rank computes its vocabulary range and these rows are gathered)."""
        if self.logits_head is not None:  # set by kvserve.quant in quantized modes
            logits = self.logits_head(hidden)
        else:
            weight = self.model.embed_tokens.weight if self.lm_head is None \
                else self.lm_head.weight
            logits = F.linear(hidden, weight)
        if self.parallel is not None:
            logits = gather_vocab(logits, self.parallel)[:, : self.config.vocab_size]
        logits = logits.float()
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma 2, as HF: divide, tanh, multiply
            logits = torch.tanh(logits / cap) * cap
        return logits

    def bind_kv_cache(self, kv_caches: list[torch.Tensor],
                      kv_groups: list[int] | None = None) -> None:
        """Give the stage's layer i the tensor kv_caches[i] of shape
        [2, blocks, block_size, kv_heads, dim], and (the hybrid layout) the KV cache group
        kv_groups[i] whose block tables it reads (default: group 0)."""
        layers = self.model.stage_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"need {len(layers)} KV tensors, got {len(kv_caches)}")
        groups = kv_groups or [0] * len(layers)
        for layer, cache, group in zip(layers, kv_caches, groups):
            layer.self_attn.kv_cache = cache
            layer.self_attn.kv_group = group
        self.model.reset_decode_stack()

    @torch.no_grad()
    def shift_keys(self, block_ids: list[int], delta: int) -> None:
        """Rotate the keys held in `block_ids` by `delta` positions, in every layer of this
        stage: attention sinks move the window's keys back by the evicted length (RoPE is a
        rotation by position, so a key written at p becomes the key written at p + delta, up
        to one rounding in the cache's dtype)."""
        index = torch.tensor(block_ids, dtype=torch.long)
        rotations = {kind: table.rotation(delta) for kind, table in self.model.rotaries.items()}
        for layer in self.model.stage_layers:
            keys = layer.self_attn.kv_cache[0]
            keys[index] = rotate_cached_keys(keys[index], rotations[layer.self_attn.rope_kind])

    def bind_kv_connector(self, hooks) -> None:
        """A KV connector's worker side whose per-layer hooks the stage's layers call (its
        layer index is the position in `bind_kv_cache`'s list)."""
        self.model.kv_connector = hooks

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters, casting to their dtype."""
        params = dict(self.named_parameters())
        order = rotary_head_order(self.config)  # our Q/K head layout (partial rotary), or None
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "rope_freqs.weight":
                self.model.rotary_emb.freq_factors.copy_(tensor)
                self.model.rotary_emb.reset_tables()
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if "rotary_emb.inv_freq" in name or not self.holds(name):
                continue
            target, shard = _fused_target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            tensor = _reorder_rotary_rows(tensor, name, self.config, order)
            _shard_view(param, shard, self.config, target).copy_(tensor)
            loaded.add(name)
        self._check_complete(loaded)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Our parameters under HF checkpoint names, fused projections split unless the family's
        checkpoints keep them fused, Q/K rows in HF's order (for export)."""
        params = dict(self.named_parameters())
        order = rotary_head_order(self.config)
        inverse = None if order is None else torch.argsort(order)
        state = {}
        for name in filter(self.holds, hf_parameter_names(self.config)):
            target, shard = _fused_target(name)
            tensor = _shard_view(params[target], shard, self.config, target).clone()
            state[name] = _reorder_rotary_rows(tensor, name, self.config, inverse)
        return state

    def _check_complete(self, loaded: set[str]) -> None:
        expected = set(filter(self.holds, hf_parameter_names(self.config)))
        missing = sorted(expected - loaded)
        if missing:
            from kvserve.errors import CorruptModelFileError

            raise CorruptModelFileError(
                f"checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}"
            )


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _fused_target(name: str) -> tuple[str, int | None]:
    for fragment, (fused, shard) in _FUSED_SHARDS.items():
        if fragment in name:
            return name.replace(fragment, fused), shard
    return name, None


def _reorder_rotary_rows(tensor: torch.Tensor, name: str, config: ModelConfig,
                         order: torch.Tensor | None) -> torch.Tensor:
    """An HF-named query/key tensor (projection rows, bias, QK-norm weight; Phi-3's fused qkv
    rows too) with each head's dims taken in `order` (`rotary_head_order`, or its inverse
    for export); any other tensor as given. Heads are whole in every tensor-parallel shard."""
    if order is None:
        return tensor
    if ".q_norm." in name or ".k_norm." in name:
        return tensor[order]
    if ".q_proj." in name or ".k_proj." in name:
        return _reorder_heads(tensor, order)
    if ".qkv_proj." in name:
        query, key, value = tensor.split([config.q_size, config.kv_size, config.kv_size])
        return torch.cat([_reorder_heads(query, order), _reorder_heads(key, order), value])
    return tensor


def _reorder_heads(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    head_dim = order.shape[0]
    heads = rows.reshape(-1, head_dim, *rows.shape[1:])
    return heads[:, order].reshape(rows.shape)


def _shard_view(param: torch.Tensor, shard: int | None, config: ModelConfig, name: str):
    if shard is None:
        return param.data
    if "qkv_proj" in name:
        sizes = [config.q_size, config.kv_size, config.kv_size]
    else:
        sizes = [config.intermediate_size] * 2
    return param.data.split(sizes, dim=0)[shard]


def hf_parameter_names(config: ModelConfig) -> list[str]:
    """Every HF checkpoint tensor name a complete checkpoint of this config holds."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    fused = config.architecture in FUSED_CHECKPOINT_ARCHITECTURES  # Phi-3: as our parameters
    qkv = ["qkv_proj"] if fused else ["q_proj", "k_proj", "v_proj"]
    gate_up = ["gate_up_proj"] if fused else ["gate_proj", "up_proj"]
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}.weight" for p in qkv), "self_attn.o_proj.weight",
                 *(f"mlp.{p}.weight" for p in gate_up), "mlp.down_proj.weight"]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}.bias" for p in qkv]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if config.sandwich_norms:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    for i in range(config.num_hidden_layers):
        names += [f"model.layers.{i}.{suffix}" for suffix in per_layer]
    return names
