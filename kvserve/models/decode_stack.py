"""The decoder layers as one C++ call (kernels/csrc/decode_stack.cpp): the CPU's counterpart of
capturing a CUDA graph for decode steps. A step through the fused path makes ~9 Python calls per
layer, each with attribute lookups and binding overhead (~1.5 ms of a ~12 ms batch-1 step on a
Zen 3); the stack runs the same ops in the same order from C++, so its outputs are the same to
the bit (tests/test_decode_stack.py).

It applies to a model on the fused path with the compiled kernels, whole (one pipeline stage, no
tensor parallelism, no layer-wise KV connector) of plain Llama layers (no QK-norm, no Gemma
norms or GeGLU, one RoPE table), whose projections our kernels or a
dense GEMM serve, and to steps whose every sequence takes the paged attention kernel (decodes
and short chunks; the others take the Python path). `--enforce-eager` (vLLM's name) turns it off.
"""

from __future__ import annotations

from torch import nn

from kvserve.quant.linear import Bf16PanelLinear, Int4WeightOnlyLinear, W4A8Linear


def build_decode_stack(inner: nn.Module):
    """The DecodeStack of a LlamaModel (the decoder, without its LM head), or None where it does
    not apply (see the module's docstring)."""
    ops = inner.ops
    if ops is None or not getattr(ops, "compiled", False) or not hasattr(ops, "DecodeStack"):
        return None
    if not (inner.is_first_stage and inner.is_last_stage) or not inner.stage_layers:
        return None
    layers = []
    for layer in inner.stage_layers:
        attention, mlp = layer.self_attn, layer.mlp
        if attention.kv_cache is None or attention.tp is not None or mlp.tp is not None:
            return None
        if not _stack_runs_layer(layer):
            return None
        projections = [_stack_linear(ops, module) for module in
                       (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in projections):
            return None
        layers.append(ops.StackLayer(layer.input_layernorm.weight,
                                     layer.post_attention_layernorm.weight, attention.kv_cache,
                                     *projections, attention.sliding_window))
    first = inner.stage_layers[0].self_attn
    return ops.DecodeStack(layers, inner.norm.weight, inner.norm.eps, first.num_heads,
                           first.num_kv_heads, first.head_dim, first.scale)


def _stack_runs_layer(layer: nn.Module) -> bool:
    """Whether the stack's ops are the layer's: SwiGLU between one pre-attention and one pre-MLP
    Llama RMSNorm, attention on the global RoPE table, no QK-norm."""
    attention = layer.self_attn
    return (attention.q_norm is None and attention.rope_kind == "global" and not attention.softcap
            and not layer.sandwich_norms and layer.mlp.hidden_act == "silu"
            and not layer.input_layernorm.weight_offset)


def _stack_linear(ops, module: nn.Module):
    """A projection as the stack's StackLinear (its kernel kind, weights, row limit), or None
    for a kind the stack does not run."""
    if isinstance(module, W4A8Linear):
        return ops.StackLinear("int4_q8", module.panels, module.dense_weight, module.bias,
                               module.out_features, module.max_rows)
    if isinstance(module, Bf16PanelLinear):
        return ops.StackLinear("bf16", module.panels, module.dense_weight, module.bias,
                               module.out_features, module.max_rows)
    if isinstance(module, Int4WeightOnlyLinear):
        if module.ops is None:  # torch's int4 kernel: not in the stack
            return None
        return ops.StackLinear("int4", module.panels, module.dense_weight, module.bias,
                               module.out_features, module.max_rows)
    if type(module) is nn.Linear:
        return ops.StackLinear("dense", module.weight, module.weight, module.bias,
                               module.out_features, 0)
    return None
