"""What each step asked of the machine: its tokens, FLOPs and bytes, and how long it took.

The bottleneck doctor (kvserve.bottleneck) places a window of steps against this machine's
roof: time the bytes need at the measured bandwidth, time the FLOPs need at the measured GEMM
rate, against the time the steps took. The ledger only counts (cumulative totals, sent with the
core's stats); the counts are estimates from the model's shape, as the roofline's are:

- FLOPs: 2 x the decoder's weights per scheduled token, the LM head per sampled row, and the
  attention's 4 x q_size per (query, context) pair per layer (causal within a chunk);
- bytes: every weight once per step (a mixture of experts' top-k experts and shared expert, as
  kvserve.roofline counts them: a batch reads up to all experts, so this undercounts them), plus
  each scheduled request's context K/V read once and its new tokens' K/V written (kept apart
  too: they say whether a smaller KV dtype would help).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.roofline import (
    MachineRoof,
    ModelCost,
    cached_roof,
    format_cost,
    roof_gemm_dtype,
    weight_format,
)

logger = logging.getLogger(__name__)


@dataclass
class StepTotals:
    """Cumulative since the core started (the front-end takes differences over a window)."""
    steps: int = 0
    seconds: float = 0.0  # the steps' wall time in the core: schedule, run, update
    tokens: int = 0
    prefill_tokens: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    kv_bytes: float = 0.0  # of `bytes`, the K/V read and written


class StepLedger:
    def __init__(self, cost: ModelCost, attention_flops_per_pair: float,
                 kv_bytes_per_token: float, roof: MachineRoof, gemm_dtype: str):
        self.cost = cost
        self.attention_flops_per_pair = attention_flops_per_pair
        self.kv_bytes_per_token = kv_bytes_per_token
        self.roof = roof
        self.gemm_gflops = roof.gemm_gflops.get(gemm_dtype, roof.gemm_gflops["float32"])
        self.totals = StepTotals()

    def record(self, scheduled, seconds: float) -> None:
        """One step's ScheduledRequests and its wall time."""
        if not scheduled:
            return
        cost, totals = self.cost, self.totals
        tokens = sampled = prefill = pairs = context = 0
        for item in scheduled:
            new, start = item.num_new_tokens, item.start_position
            tokens += new
            sampled += item.sample
            pairs += new * start + new * (new + 1) // 2
            context += start + new
            if start < item.request.num_prompt_tokens:
                prefill += new
        totals.steps += 1
        totals.seconds += seconds
        totals.tokens += tokens
        totals.prefill_tokens += prefill
        totals.flops += (tokens * cost.layer_flops_per_token
                         + sampled * cost.lm_head_flops_per_token
                         + pairs * self.attention_flops_per_pair)
        kv_bytes = (context + tokens) * self.kv_bytes_per_token
        totals.bytes += cost.weight_bytes + kv_bytes
        totals.kv_bytes += kv_bytes


def make_step_ledger(model_config: ModelConfig, dtype: torch.dtype, quantization: str,
                     kv_bytes_per_token: float) -> StepLedger | None:
    """The ledger for this engine's weights and KV layout, with the machine's roof measured (or
    read from the cache); None, with a log line, for a format the cost model does not know
    (the doctor then has nothing to say, the engine runs as ever)."""
    dtype_name = str(dtype).removeprefix("torch.")
    try:
        fmt = weight_format(dtype_name, quantization, model_config.source_weight_type)
        cost = format_cost(model_config, fmt)
        roof = cached_roof(model_config)
    except (KeyError, ValueError, OSError) as exc:
        logger.info("no step ledger (the bottleneck doctor is off): %s: %s",
                    type(exc).__name__, exc)
        return None
    attention = 4.0 * model_config.num_hidden_layers * model_config.q_size
    return StepLedger(cost, attention, kv_bytes_per_token, roof,
                      roof_gemm_dtype(dtype_name, roof.native_bf16))
