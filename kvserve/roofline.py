"""The machine's roof (memory bandwidth, GEMM rates) and the model's cost per token, in one
place, so every benchmark result, the planner and the engine's bottleneck doctor state time as a
fraction of what the hardware allows.

Decode at batch B streams every weight once per step and each sequence's KV once per token, so
its roof is min(bandwidth / bytes per token, GEMM rate / FLOPs per token); prefill is
compute-bound, its roof is the GEMM rate / FLOPs per token. Both are stated for the engine's
default format on this CPU (dtype, quantization) unless asked for another: bf16 only where the
CPU runs it natively, bytes per weight of the quantized layout.

Below the engine's layers (the core's step ledger uses it); the benchmark reports built on it
are kvserve.bench.roofline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvserve import platform
from kvserve.config import ModelConfig

GEMM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
INT4_GROUP_SIZE = 32  # as kvserve.quant.linear (GGUF Q4_1 blocks)


@dataclass(frozen=True)
class MachineRoof:
    memory_gbps: float
    gemm_gflops: dict[str, float]  # dtype name -> GFLOP/s at the model's shapes
    threads: int
    native_bf16: bool = True  # False: the bf16 rate is torch's emulation, never a roof


@dataclass(frozen=True)
class WeightFormat:
    """Bytes a decode step reads per weight: decoder layers and LM head apart, since every
    quantized mode keeps the LM head in int8."""
    dtype: str
    quantization: str
    layer_bytes_per_weight: float
    head_bytes_per_weight: float


@dataclass(frozen=True)
class ModelCost:
    layer_flops_per_token: float  # linear layers, 2 x parameters
    lm_head_flops_per_token: float
    weight_bytes: float  # layer + embedding weights read per step, at the given dtype
    kv_bytes_per_token: float


def weight_format(dtype: str, quantization: str, source_type: str | None = None
                  ) -> WeightFormat:
    """int4: 4-bit codes plus a scale and a zero per group of 32, both in the activation dtype
    (bf16: 0.5 + 4/32 = 0.625 bytes); w4a8: float16 scale and low (0.625); int8/w8a8: 1 byte
    (per-channel scales add < 1%); gguf: the bytes our panels of the file's block type
    (`source_type`, its layers') take (Q4_K 0.578, Q4_1 0.625); fp8: Q8_0's panels; the LM
    head of every quantized mode taken as int8; none: the dtype's width."""
    element = DTYPE_BYTES[dtype]
    if quantization == "none":
        return WeightFormat(dtype, quantization, element, element)
    if quantization in ("gguf", "fp8"):  # fp8 layers are held as Q8_0 panels
        from kvserve.kernels.reference import GGUF_FORMATS

        values, _, panel_bytes = GGUF_FORMATS["Q8_0" if quantization == "fp8" else source_type]
        return WeightFormat(dtype, quantization, panel_bytes / (16 * values), 1.0)
    if quantization == "int4":
        layer = 0.5 + 2 * element / INT4_GROUP_SIZE
    elif quantization == "w4a8":  # float16 scales and lows (a GGUF's Q4_1)
        layer = 0.5 + 2 * 2 / INT4_GROUP_SIZE
    elif quantization in ("int8", "w8a8"):
        layer = 1.0
    else:
        raise ValueError(f"unknown quantization {quantization!r}")
    return WeightFormat(dtype, quantization, layer, 1.0)


def engine_dtype() -> str:
    """The dtype the engine picks on this CPU (kvserve.platform.default_dtype)."""
    from kvserve.platform import default_dtype

    return str(default_dtype("cpu")).removeprefix("torch.")


def engine_quantization(config: ModelConfig, dtype: str, dtype_is_default: bool = True) -> str:
    """What `--quantization auto` resolves to for this checkpoint and dtype (on the compiled
    kernels of this machine's selected level, as the engine loads them)."""
    from kvserve.kernels import get_ops
    from kvserve.quant import resolve_quantization

    return resolve_quantization("auto", config.source_weight_type, GEMM_DTYPES[dtype],
                                dtype_is_default and get_ops().int4_linear_fast())


def resolve_format(config: ModelConfig, dtype: str = "auto", quantization: str = "auto"
                   ) -> WeightFormat:
    dtype_is_default = dtype == "auto"
    dtype = engine_dtype() if dtype_is_default else dtype
    if quantization == "auto":
        quantization = engine_quantization(config, dtype, dtype_is_default)
    return weight_format(dtype, quantization, config.source_weight_type)


def roof_gemm_dtype(dtype: str, native_bf16: bool) -> str:
    """The GEMM rate that bounds the roof: the model's dtype, except emulated bf16 (a measure of
    torch's fallback, not of the hardware), where fp32 is what the CPU can do."""
    return "float32" if dtype == "bfloat16" and not native_bf16 else dtype


def model_cost(config: ModelConfig, bytes_per_weight: float = 2.0,
               bytes_per_kv_value: float = 2.0, head_bytes_per_weight: float | None = None
               ) -> ModelCost:
    hidden = config.hidden_size
    attention = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden
    layer_params = sum(attention + _mlp_params(config, layer)
                       for layer in range(config.num_hidden_layers))
    head_params = hidden * config.vocab_size
    return ModelCost(
        layer_flops_per_token=2.0 * layer_params,
        lm_head_flops_per_token=2.0 * head_params,
        weight_bytes=layer_params * bytes_per_weight + head_params * (
            bytes_per_weight if head_bytes_per_weight is None else head_bytes_per_weight),
        kv_bytes_per_token=2.0 * config.num_hidden_layers * config.kv_size * bytes_per_kv_value,
    )


def _mlp_params(config: ModelConfig, layer: int) -> int:
    """The MLP weights one token reads in `layer`: a dense layer's all; a mixture of experts'
    router, its top-k experts and the shared expert (what a batch-1 step reads; a batch reads
    the union of its tokens' experts, up to all of them)."""
    hidden = config.hidden_size
    if not config.is_moe_layer(layer):
        return 3 * hidden * config.intermediate_size
    shared = config.shared_expert_intermediate_size
    return (hidden * config.num_experts
            + 3 * hidden * config.moe_intermediate_size * config.num_experts_per_tok
            + (3 * hidden * shared + hidden if shared else 0))


def format_cost(config: ModelConfig, fmt: WeightFormat) -> ModelCost:
    """The model's cost per token in a weight format (the KV cache is in the model's dtype)."""
    return model_cost(config, fmt.layer_bytes_per_weight, DTYPE_BYTES[fmt.dtype],
                      fmt.head_bytes_per_weight)


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s of a streaming read (a float32 sum over a buffer far larger than any L3)."""
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    seconds = _best_time(lambda: data.sum(), repeats)
    return data.numel() * 4 / seconds / 1e9


def measure_gemm(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of an (m x k) @ (k x n) matmul."""
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    seconds = _best_time(lambda: a @ b, repeats)
    return 2.0 * m * k * n / seconds / 1e9


def measure_roof(config: ModelConfig, batch_tokens: int = 256) -> MachineRoof:
    """Bandwidth plus fp32 and bf16 GEMM rates at the model's MLP shape (batch_tokens x hidden x
    2*ffn); bf16 is measured even where emulated, and marked so."""
    shape = (batch_tokens, config.hidden_size, 2 * config.intermediate_size)
    rates = {name: measure_gemm(*shape, dtype) for name, dtype in GEMM_DTYPES.items()}
    return MachineRoof(measure_memory_bandwidth(), rates, torch.get_num_threads(),
                       platform.cpu_has_native_bf16())


def decode_roof_tokens_per_s(cost: ModelCost, roof: MachineRoof, batch: int, context: int,
                             dtype: str = "bfloat16") -> float:
    """Upper bound on decode output tokens/s at a batch size and mean context length."""
    bytes_per_token = cost.weight_bytes / batch + cost.kv_bytes_per_token * context
    flops = cost.layer_flops_per_token + cost.lm_head_flops_per_token
    memory_bound = roof.memory_gbps * 1e9 / bytes_per_token
    compute_bound = roof.gemm_gflops[dtype] * 1e9 / flops
    return min(memory_bound, compute_bound)


def prefill_roof_tokens_per_s(cost: ModelCost, roof: MachineRoof, dtype: str = "bfloat16"
                              ) -> float:
    return roof.gemm_gflops[dtype] * 1e9 / cost.layer_flops_per_token


# ---- the roof the engine measures once per machine, for its bottleneck doctor ----------------
ROOF_CACHE_FILE = "roofs.json"


def _machine_key(threads: int) -> str:
    from kvserve.kernels import isa

    cpu = isa.cpu_description()
    return (f"{cpu['model_name']}|f{cpu['family']}m{cpu['model']}|{isa.selected_level()}|"
            f"t{threads}")


def cached_roof(config: ModelConfig) -> MachineRoof:
    """This machine's roof for this process's torch threads: its bandwidth, and its GEMM rates
    at the model's MLP shape, each measured once and kept in the cache directory (under a
    second the first time on 2 cores, a file read after; $KVSERVE_ROOF_FILE names another
    file), so every engine start can place its steps against it. A measure taken while the
    machine was busy reads low: it is taken again once the load average is under half of what
    it was then, and each rate kept at the best seen."""
    import json
    import os
    from pathlib import Path

    from kvserve.paths import cache_dir

    path = Path(os.environ.get("KVSERVE_ROOF_FILE") or cache_dir() / ROOF_CACHE_FILE)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    machine = _machine_key(torch.get_num_threads())
    shape = (256, config.hidden_size, 2 * config.intermediate_size)
    load, changed = os.getloadavg()[0], False

    def measured(key: str, measure) -> dict:
        nonlocal changed
        entry = known.get(key)
        if isinstance(entry, dict) and load >= entry["load"] / 2:
            return entry
        value = measure()
        if isinstance(entry, dict):  # the best of then and now, at the lower load
            value = {name: max(rate, entry["value"].get(name, 0.0))
                     for name, rate in value.items()}
            load_then = min(load, entry["load"])
        else:
            load_then = load
        known[key], changed = {"value": value, "load": load_then}, True
        return known[key]

    memory = measured(f"{machine}|memory", lambda: {"gbps": measure_memory_bandwidth()})
    gemm = measured(f"{machine}|gemm{'x'.join(map(str, shape))}", lambda: {
        name: measure_gemm(*shape, dtype) for name, dtype in GEMM_DTYPES.items()})
    if changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(known, indent=1))
        os.replace(temporary, path)  # atomic: engines starting together never read half
    return MachineRoof(memory["value"]["gbps"], gemm["value"], torch.get_num_threads(),
                       platform.cpu_has_native_bf16())
