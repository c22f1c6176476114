"""A serving run's rates as fractions of the machine's roof, and the roof as `kvserve bench
roofline` reports it; the roof and the model's cost per token are kvserve.roofline (re-exported
here for the benchmark code)."""

from __future__ import annotations

from dataclasses import asdict

from kvserve.config import ModelConfig
from kvserve.roofline import (  # noqa: F401 - re-exported for the benchmarks
    DTYPE_BYTES,
    GEMM_DTYPES,
    INT4_GROUP_SIZE,
    MachineRoof,
    ModelCost,
    WeightFormat,
    decode_roof_tokens_per_s,
    engine_dtype,
    engine_quantization,
    format_cost,
    measure_gemm,
    measure_memory_bandwidth,
    measure_roof,
    model_cost,
    prefill_roof_tokens_per_s,
    resolve_format,
    roof_gemm_dtype,
    weight_format,
)

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


DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 384  # s1/s2's mean context: a 256-token prompt plus half of 128 outputs


def roof_payload(roof: MachineRoof, config: ModelConfig, fmt: WeightFormat, header: dict
                 ) -> dict:
    """The measured machine, the model's cost in `fmt`, and the decode and prefill roofs."""
    gemm_dtype = roof_gemm_dtype(fmt.dtype, roof.native_bf16)
    cost = format_cost(config, fmt)
    payload = roof_as_dict(roof, cost)
    payload.update(cpu=header, weight_format=asdict(fmt), roof_gemm_dtype=gemm_dtype)
    payload["decode_roof_tok_s"] = {
        f"batch {batch}": decode_roof_tokens_per_s(cost, roof, batch, DECODE_CONTEXT, gemm_dtype)
        for batch in DECODE_BATCHES}
    payload["prefill_roof_tok_s"] = prefill_roof_tokens_per_s(cost, roof, gemm_dtype)
    return payload


def roof_summary(payload: dict) -> list[str]:
    """The payload as lines for a terminal: what was measured and which format the roof is for."""
    from kvserve.bench.machine import cpu_label

    machine, fmt = payload["machine"], payload["weight_format"]
    bf16_kind = "native" if machine.get("native_bf16", True) else "emulated, never a roof"
    decode = ", ".join(f"{key} {value:.0f}" for key, value in payload["decode_roof_tok_s"].items())
    return [
        f"CPU: {cpu_label(payload['cpu'])}; {machine['threads']} threads",
        f"memory: {machine['memory_gbps']:.1f} GB/s streaming read (512 MB)",
        f"GEMM at the model's MLP shape: float32 {machine['gemm_gflops']['float32']:.0f} GFLOP/s, "
        f"bfloat16 {machine['gemm_gflops']['bfloat16']:.0f} GFLOP/s ({bf16_kind})",
        f"roof for: dtype {fmt['dtype']}, quantization {fmt['quantization']} "
        f"({fmt['layer_bytes_per_weight']:g} bytes/weight in the layers, "
        f"{fmt['head_bytes_per_weight']:g} in the LM head), {payload['roof_gemm_dtype']} GEMM "
        f"rate, kernels {payload['cpu']['isa_level']}",
        f"weights read per decode step: {payload['model']['weight_bytes'] / 1e6:.1f} MB",
        f"decode roof at context {DECODE_CONTEXT}, tok/s: {decode}",
        f"prefill roof: {payload['prefill_roof_tok_s']:.0f} tok/s",
    ]
