"""The decoder stack every family shares: the token embedding, the RoPE tables its layers use,
the family's decoder layers, the final norm, and one forward over a flattened ragged batch:
`forward(input_ids[T], positions[T], attn_metadata) -> hidden[T, H]`, no padding, no requests.

The residual stream is kept beside the hidden states and each "add, then RMSNorm" is one op
(vLLM's fused_add_rms_norm). A family's decoder layer is `layer(ops, positions, hidden,
residual, metadata) -> (hidden, residual)`, written once against the op set: the same code runs
the compiled kernels, their torch versions (the reference backends) and, recorded once, the
decode stack (models/decode_stack.py: the layers as one C++ call for steps whose sequences the
paged or flash kernel attends; `enforce_eager` keeps Python's loop).

Given pp_size > 1 the model is one pipeline stage: it builds only its decoder layers (the others
are parameterless `PPMissingLayer`s, so parameter names keep their global layer index), the
embedding on the first stage, the final norm on the last. A stage other than the first starts
from the previous stage's `IntermediateTensors`; one other than the last returns its own.

A KV connector that moves KV layer by layer is bound with `bind_kv_connector` (on the CausalLM):
each stage layer i then calls its `wait_for_layer_load(i)` before running and `save_kv_layer(i,
cache, metadata)` after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kvserve.attention import AttentionBackend
from kvserve.attention.paged import plan_step
from kvserve.kernels.reference import plain_scores
from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import ParallelContext, active, stage_of
from kvserve.distributed.sharding import stage_layer_counts, stage_layer_range
from kvserve.kernels import autotune, get_ops
from kvserve.models.layers.embedding import TokenEmbedding
from kvserve.models.layers.norm import RMSNorm
from kvserve.models.layers.ops import LayerOps
from kvserve.models.layers.rotary import RotaryEmbedding


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: the hidden states and the residual stream kept
    beside them."""

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


# layer_factory(index, prefix, rotary) -> the family's decoder layer
LayerFactory = Callable[[int, str, RotaryEmbedding], nn.Module]


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 parallel: ParallelContext | None, make_layer: LayerFactory,
                 norm_weight_offset: float = 0.0, embedding_multiplier: float | None = None,
                 quant=None):
        super().__init__()
        pp_rank, pp_size = stage_of(parallel)
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        counts = (parallel.layer_partition if parallel is not None and parallel.layer_partition
                  else stage_layer_counts(config, pp_size))
        self.start_layer, self.end_layer = stage_layer_range(list(counts), pp_rank)
        # the last stage keeps the embedding too when the LM head is tied to it
        self.holds_embedding = self.is_first_stage or (self.is_last_stage
                                                       and config.tie_word_embeddings)
        self.embed_tokens = TokenEmbedding(config.vocab_size, config.hidden_size, parallel,
                                           quant) if self.holds_embedding else PPMissingLayer()
        self.embedding_multiplier = embedding_multiplier
        self.rotary_emb = RotaryEmbedding(config)  # the global table: every layer's but these
        kinds = {config.layer_rope(i) for i in range(self.start_layer, self.end_layer)}
        self.local_rotary_emb = RotaryEmbedding(config, "local") if "local" in kinds else None
        self.no_rotary_emb = RotaryEmbedding(config, "none") if "none" in kinds else None
        tables = self.rotaries
        self.layers = nn.ModuleList(
            make_layer(i, f"model.layers.{i}", tables[config.layer_rope(i)])
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers))
        self.stage_layers = [self.layers[i] for i in range(self.start_layer, self.end_layer)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_weight_offset) \
            if self.is_last_stage else PPMissingLayer()
        # the op set (compiled kernels or their torch versions); a backend that brings none
        # (one that only attends) runs its model's other ops on the torch versions
        self.ops = getattr(backend, "ops", None) or get_ops(False)
        self.layer_ops = LayerOps(self.ops, backend)
        self.tp = active(parallel)
        self.kv_connector = None  # a layer-wise KV connector's hooks (worker side), if bound
        # The decoder layers as one C++ call for decode steps (models/decode_stack.py), built on
        # the first step that can use it; `enforce_eager` (--enforce-eager) keeps Python's loop.
        self.enforce_eager = False
        # LoRA (models/lora/): each step's row slots; the stack and the Python loop both add
        # each projection's adapters' products with ops.lora_add_
        self.lora_batch = None
        self._decode_stack: object | None | bool = None  # False: does not apply to this model
        self._kernel_limits = autotune.generation()  # the decode stack is built with these

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
        """Recompute every RoPE table in float32 (after loading, casting or moving); a decode
        stack recorded the old tables, so it is rebuilt."""
        device = self.rotary_emb.freq_factors.device
        for table in self.rotaries.values():
            table.float().reset_tables(device)
        self.reset_decode_stack()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, times Gemma's sqrt(hidden) in their dtype (as HF rounds it)."""
        hidden = self.embed_tokens.forward(input_ids)
        if self.embedding_multiplier is None:
            return hidden
        return hidden * torch.tensor(self.embedding_multiplier).to(hidden.dtype)

    def forward(self, input_ids, positions, metadata,
                intermediate: IntermediateTensors | None = None):
        """Hidden states [T, H] on the last stage; the stage's IntermediateTensors elsewhere.
        `intermediate`: the previous stage's (every stage but the first). The autotuner's
        background measurements wait while it runs."""
        limits = autotune.step_started()
        try:
            if limits != self._kernel_limits:  # the autotuner changed a projection's row limit
                self._kernel_limits = limits
                self.reset_decode_stack()
            return self._forward(input_ids, positions, metadata, intermediate)
        finally:
            autotune.step_finished()

    def _forward(self, input_ids, positions, metadata, intermediate):
        stack = self._stack_for(metadata, intermediate)
        if stack is not None:
            plan = metadata.plan
            return stack.run(self.embed(input_ids), positions, metadata.slot_mapping,
                             plan.paged_seq_ids, plan.flash_seq_ids, plan.query_start_loc,
                             metadata.seq_lens, metadata.block_tables,
                             self.lora_batch.slots if self.lora_batch is not None else None)
        if intermediate is None:  # the first layer takes the embedding as its residual
            residual, hidden = None, self.embed(input_ids)
        else:
            residual, hidden = intermediate.residual, intermediate.hidden
        hidden, residual = self.run_layers(self.layer_ops, positions, hidden, residual, metadata,
                                           self.kv_connector)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual)
        return hidden

    def run_layers(self, ops, positions, hidden, residual, metadata, hooks=None):
        """The stage's layers and, on the last stage, the final norm (added to the residual),
        on `ops`: the model's LayerOps, or the decode stack's recorder."""
        for i, layer in enumerate(self.stage_layers):
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            hidden, residual = layer.forward(ops, positions, hidden, residual, metadata)
            if hooks is not None:
                hooks.save_kv_layer(i, layer.self_attn.kv_cache, metadata)
        if self.is_last_stage:
            ops.add_rms_norm_(hidden, residual, self.norm)
        return hidden, residual

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
            if self._decode_stack is False:
                return None
            # whether PagedBackend.attend plans flash rows (the Python path reuses our plan),
            # and whether the stack can run them (an int8 cache is dequantized for flash)
            attention = self.stage_layers[0].self_attn
            self._stack_plans_flash = self.layer_dtype == torch.bfloat16 and \
                plain_scores(attention.softcap, attention.sinks) and \
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

    @property
    def layer_dtype(self) -> torch.dtype:
        """The activations' dtype: the first layer's float parameters' (its norms')."""
        return next(p.dtype for p in self.stage_layers[0].parameters()
                    if p.is_floating_point())

    def reset_decode_stack(self) -> None:
        """Forget the stack (new KV tensors, changed layers, new row limits) and the fused MoE
        layers, which copied their projections' row limits: the next step builds them again."""
        self._decode_stack = None
        for module in self.modules():
            if hasattr(module, "reset_fused"):
                module.reset_fused()
