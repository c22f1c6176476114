"""The decoder layers as one C++ call (kernels/csrc/decode_stack.cpp): the CPU's counterpart of
capturing a CUDA graph for decode steps. A step through Python makes ~9 op calls per layer,
each with attribute lookups and binding overhead (~1.5 ms of a ~12 ms batch-1 step on a Zen 3);
the stack runs the same ops in the same order from C++, so its outputs are the same to the bit
(tests/test_decode_stack.py).

The program is not written here: it is recorded by running the model's own `run_layers` once
with a `Recorder` in place of the op set, so every family's layers (Llama's, Gemma's sandwich
norms and GeGLU, QK-norm, per-layer RoPE tables, windows, soft caps) become a program of the
ops they call. A layer that calls something the stack cannot run (a projection kind it has no
kernel for, a tensor-parallel all-reduce) makes the model keep its Python loop. It applies to a
whole model (one pipeline stage, no layer-wise KV connector, one KV cache group) with the
compiled kernels, and to steps whose every sequence takes the paged attention kernel or, over a
bf16 cache, the flash kernel (models/layers/decoder.py decides per step). `--enforce-eager`
(vLLM's name) turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

# kvserve::StackOp
(RMS_NORM, ADD_RMS_NORM, LINEAR, SILU_AND_MUL, GELU_AND_MUL, NORM_HEADS, ATTENTION, ADD,
 NORM_PROJECTIONS, CLAMP, MOE) = range(11)


class Unsupported(Exception):
    """The layers call an op the stack cannot run."""


@dataclass(frozen=True)
class Value:
    """A tensor of the recorded step: a virtual register."""

    register: int


@dataclass
class Instruction:
    op: int
    dst: Value | None = None
    src: Value | None = None
    aux: Value | None = None
    settings: dict = field(default_factory=dict)


class Recorder:
    """`LayerOps`' methods (models/layers/ops.py), recording the op each would run."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.program: list[Instruction] = []
        self.registers = 1  # register 0: the stack's input, the embedded tokens

    def _emit(self, op: int, src: Value, aux: Value | None = None, produces: bool = True,
              **settings) -> Value | None:
        dst = Value(self.registers) if produces else None
        self.registers += produces
        self.program.append(Instruction(op, dst, src, aux, settings))
        return dst

    def rms_norm(self, x: Value, norm: nn.Module) -> Value:
        return self._emit(RMS_NORM, x, **_norm_settings(norm))

    def add_rms_norm_(self, x: Value, residual: Value, norm: nn.Module) -> None:
        self._emit(ADD_RMS_NORM, x, residual, produces=False, **_norm_settings(norm))

    def linear(self, layer: nn.Module, x: Value) -> Value:
        if getattr(layer, "tp", None) is not None:
            raise Unsupported("a tensor-parallel projection (its all-reduce)")
        stack_linear = layer.method.stack_linear(layer, self.kernels)
        if stack_linear is None:
            raise Unsupported(f"{type(layer.method).__name__}'s kernel")
        return self._emit(LINEAR, x, linear=stack_linear, **_lora_settings(layer))

    def add_(self, x: Value, other: Value) -> None:
        self._emit(ADD, x, other, produces=False)

    def act_and_mul(self, gate_up: Value, activation: str, mlp: nn.Module | None = None) -> Value:
        if activation == "swigluoai":
            raise Unsupported("gpt-oss's activation outside its fused mixture of experts")
        return self._emit(SILU_AND_MUL if activation == "silu" else GELU_AND_MUL, gate_up)

    def norm_heads_(self, qkv: Value, attention: nn.Module) -> None:
        q_norm, k_norm = attention.q_norm, attention.k_norm
        self._emit(NORM_HEADS, qkv, produces=False, weight=q_norm.weight,
                   key_weight=k_norm.weight, eps=q_norm.eps, weight_offset=q_norm.weight_offset,
                   **_head_settings(attention))

    def attention(self, attention: nn.Module, qkv: Value, positions, metadata) -> Value:
        if attention.kv_cache is None or attention.kv_group:
            raise Unsupported("an attention layer without its cache, or in another group")
        return self._emit(ATTENTION, qkv, kv_cache=attention.kv_cache,
                          cos_sin=attention.rotary.cos_sin, scale=attention.scale,
                          sliding_window=attention.sliding_window, softcap=attention.softcap,
                          sinks=attention.sink_logits, **_head_settings(attention))

    def latent_attention(self, attention: nn.Module, *args) -> Value:
        raise Unsupported("latent attention (MLA), whose attention runs in torch")

    def norm_projections_(self, qkv: Value, attention: nn.Module) -> None:
        q_norm, k_norm = attention.q_norm, attention.k_norm
        self._emit(NORM_PROJECTIONS, qkv, produces=False, weight=q_norm.weight,
                   key_weight=k_norm.weight, eps=q_norm.eps, weight_offset=q_norm.weight_offset,
                   **_head_settings(attention))

    def clamp_(self, x: Value, limit: float) -> None:
        self._emit(CLAMP, x, produces=False, limit=limit)

    def moe(self, moe: nn.Module, hidden: Value) -> Value:
        if moe.tp is not None:
            raise Unsupported("a tensor-parallel mixture of experts (its all-reduce)")
        fused = moe.fused(self.kernels)
        if fused is None:
            raise Unsupported("a mixture of experts without its fused kernel")
        return self._emit(MOE, hidden, moe=fused)

    def all_reduce_(self, x: Value, tp) -> None:
        raise Unsupported("a tensor-parallel all-reduce")


def _lora_settings(layer: nn.Module) -> dict:
    """A projection's LoRA slots (with --enable-lora): the stack adds each row's adapter after
    the base product, as LinearLoRA.add_ does, with the same kernel."""
    lora = getattr(layer, "lora", None)
    if lora is None:
        return {}
    if not lora.compiled:
        raise Unsupported(f"LoRA slots in {lora.a.dtype} (the torch reference's)")
    return {"lora_a": lora.a, "lora_b": lora.b, "lora_gemm_rows": lora.max_rows}


def _norm_settings(norm: nn.Module) -> dict:
    return {"weight": norm.weight, "eps": norm.eps, "weight_offset": norm.weight_offset}


def _head_settings(attention: nn.Module) -> dict:
    return {"num_heads": attention.num_heads, "num_kv_heads": attention.num_kv_heads,
            "head_dim": attention.head_dim}


def build_decode_stack(inner: nn.Module):
    """The DecodeStack of a DecoderModel (the decoder, without its LM head), or None where it
    does not apply (see the module's docstring)."""
    ops = inner.ops
    if ops is None or not getattr(ops, "compiled", False) or not hasattr(ops, "DecodeStack"):
        return None
    if not (inner.is_first_stage and inner.is_last_stage) or not inner.stage_layers:
        return None
    recorder = Recorder(ops)
    try:
        hidden, _ = inner.run_layers(recorder, None, Value(0), None, None)
    except Unsupported:
        return None
    physical, count = _allocate_registers(recorder.program, hidden)
    program = [ops.StackInstruction(
        op=i.op, dst=_slot(physical, i.dst), src=_slot(physical, i.src),
        aux=_slot(physical, i.aux), **i.settings) for i in recorder.program]
    return ops.DecodeStack(program, count, physical[hidden.register])


def _slot(physical: dict[int, int], value: Value | None) -> int:
    return -1 if value is None else physical[value.register]


def _allocate_registers(program: list[Instruction], output: Value) -> tuple[dict[int, int], int]:
    """Virtual registers -> the few physical ones the C++ side keeps: a value's slot is reused
    once no later instruction reads it, so a step holds a few activations, not every layer's."""
    last_read = {0: len(program), output.register: len(program)}
    for index, instruction in enumerate(program):
        for value in (instruction.src, instruction.aux):
            if value is not None:
                last_read[value.register] = max(last_read.get(value.register, -1), index)
    physical, free, count = {0: 0}, [], 1
    for index, instruction in enumerate(program):
        dying = {value.register for value in (instruction.src, instruction.aux)
                 if value is not None and last_read[value.register] == index}
        free += [physical[register] for register in dying]  # this dst may take one
        if instruction.dst is not None:
            if free:
                physical[instruction.dst.register] = free.pop()
            else:
                physical[instruction.dst.register], count = count, count + 1
            if last_read.get(instruction.dst.register, -1) < index:  # never read
                free.append(physical[instruction.dst.register])
    return physical, count
