"""The machine's roof (memory bandwidth, GEMM rates) and the model's cost per token, in one
place, so every benchmark result can be stated as a fraction of what the hardware allows.

Decode at batch B streams every weight once per step and each sequence's KV once per token, so
its roof is min(bandwidth / bytes per token, GEMM rate / FLOPs per token); prefill is
compute-bound, its roof is the GEMM rate / FLOPs per token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from kvserve.config import ModelConfig


@dataclass(frozen=True)
class MachineRoof:
    memory_gbps: float
    gemm_gflops: dict[str, float]  # dtype name -> GFLOP/s at the model's shapes
    threads: int


@dataclass(frozen=True)
class ModelCost:
    layer_flops_per_token: float  # linear layers, 2 x parameters
    lm_head_flops_per_token: float
    weight_bytes: float  # layer + embedding weights read per step, at the given dtype
    kv_bytes_per_token: float


def model_cost(config: ModelConfig, bytes_per_weight: float = 2.0,
               bytes_per_kv_value: float = 2.0) -> ModelCost:
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden \
        + 3 * hidden * inter
    layer_params = per_layer * config.num_hidden_layers
    head_params = hidden * config.vocab_size
    return ModelCost(
        layer_flops_per_token=2.0 * layer_params,
        lm_head_flops_per_token=2.0 * head_params,
        weight_bytes=(layer_params + head_params) * bytes_per_weight,
        kv_bytes_per_token=2.0 * config.num_hidden_layers * config.kv_size * bytes_per_kv_value,
    )


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s of a streaming read (a float32 sum over a buffer far larger than cache)."""
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
    """Bandwidth plus GEMM rates at the model's MLP shape (batch_tokens x hidden x 2*ffn)."""
    shape = (batch_tokens, config.hidden_size, 2 * config.intermediate_size)
    rates = {name: measure_gemm(*shape, dtype) for name, dtype in
             (("bfloat16", torch.bfloat16), ("float32", torch.float32))}
    return MachineRoof(measure_memory_bandwidth(), rates, torch.get_num_threads())


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


def roof_fractions(summary: dict, cost: ModelCost, roof: MachineRoof, concurrency: int,
                   input_len: int, output_len: int, dtype: str = "bfloat16") -> dict:
    """A serving run's output and prefill rates as fractions of their roofs."""
    context = input_len + output_len / 2
    decode_roof = decode_roof_tokens_per_s(cost, roof, max(1, concurrency), int(context), dtype)
    prefill_roof = prefill_roof_tokens_per_s(cost, roof, dtype)
    ttft = summary.get("ttft_s", {}).get("p50")
    prefill_rate = input_len / ttft if ttft else float("nan")
    return {
        "decode_roof_tok_s": decode_roof,
        "output_fraction_of_roof": summary["output_throughput"] / decode_roof,
        "prefill_roof_tok_s": prefill_roof,
        "single_prefill_fraction_of_roof": prefill_rate / prefill_roof,
    }


def roof_as_dict(roof: MachineRoof, cost: ModelCost) -> dict:
    return {"machine": asdict(roof), "model": asdict(cost)}
