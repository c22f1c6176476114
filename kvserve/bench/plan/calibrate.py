"""`--hardware this`: this machine's roof (kvserve.bench.roofline.measure_roof) and the
engine's overheads, measured once per machine, model and kernel level and cached: a decode
step's fixed and per-sequence cost and a prefill's per-token cost beyond the roofline's time.

They are measured for each weight format (and int8 KV) the engine runs here, as
AIConfigurator keeps a table of kernel times per quantization: the formats run different
kernels (a GGUF block dequantizes in its GEMM, int4 goes through AMX int8 where the CPU has
it), which the roofline's bytes and FLOPs alone do not price. Each is fitted on a server in
that format streaming to one client (a lone prompt, then 8 short prompts at once), so the
API server's share of the cores is in it; the deployments as the bench loads them (a closed
loop of clients whose prompts meet in the token budget, other lengths, replicas, P/D) are
predicted from these, never fitted on a candidate's own run."""

from __future__ import annotations

import json
import logging
from statistics import median
from dataclasses import replace

from kvserve.bench.plan.hardware import CPU_2CORE, Hardware
from kvserve.config import ModelConfig

logger = logging.getLogger(__name__)

CALIBRATION_PROMPT = 256  # the single prefill measured, and the batch-1 decode's context
CALIBRATION_BATCH = 8  # the second decode batch (prompts of 64)
CALIBRATION_TOKENS = 33
CALIBRATION_REPEATS = 5
# a second lone prompt, still one step of the CPU's 512-token budget: two prompt lengths
# split a prefill's cost into a part per step and a part per token
CALIBRATION_LONG_PROMPT = 448
FORMAT_KEYS = "format_overheads"


def _cache_path(reference: str, header: dict):
    from kvserve.bench.machine import cpu_slug
    from kvserve.paths import cache_dir

    name = "".join(c if c.isalnum() else "-" for c in reference)[-60:]
    return cache_dir() / "plan" / f"{cpu_slug(header)}-{name}.json"


def this_machine(reference: str, config: ModelConfig, recalibrate: bool = False) -> Hardware:
    """The cached profile of this machine for `reference`, or a fresh measurement."""
    from kvserve.bench.machine import machine_header

    header = machine_header()
    path = _cache_path(reference, header)
    if path.exists() and not recalibrate:
        fields = json.loads(path.read_text())
        if "prefill_step_overhead_s" in fields:  # an older cache's fields: measured again
            return replace(_base(), **fields)
    fields = measure(reference, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields, indent=1))
    return replace(_base(), **fields)


def _base() -> Hardware:
    return replace(CPU_2CORE, name="this", sources={
        "memory_gbps": "measured now (kvserve.bench.roofline.measure_memory_bandwidth)",
        "gflops": "measured now at the model's MLP shape (measure_roof)",
        "overheads": "measured now for each weight format and int8 KV, as served: decode "
                     "steps at batch 1 and 8, one 256-token prefill "
                     "(kvserve.bench.plan.calibrate)",
        **{k: v for k, v in CPU_2CORE.sources.items()
           if k in ("memory_fraction", "engine_overhead_bytes")}})


def _memory_bytes() -> float:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    return CPU_2CORE.memory_bytes


def calibrated_formats(config: ModelConfig) -> list[tuple[str, str]]:
    """(weights, KV) pairs measured: every weight format with bf16 KV, and int8 KV on the
    default weights."""
    default = default_quantization(config)
    weights = [default] + [q for q in CPU_2CORE.quantizations if q != default]
    return [(q, "bfloat16") for q in weights] + [(default, "int8")]


def measure(reference: str, config: ModelConfig) -> dict:
    """The roof now, then the engine's overheads in each format; the scalars are the
    default format's."""
    from kvserve.bench import roofline

    roof = roofline.measure_roof(config)
    gemm = roofline.roof_gemm_dtype("bfloat16", roof.native_bf16)
    fields = dict(memory_gbps=roof.memory_gbps, memory_bytes=_memory_bytes(),
                  gflops={"bfloat16": roof.gemm_gflops[gemm],
                          "float32": roof.gemm_gflops["float32"]})
    base = replace(_base(), step_overhead_s=0.0, seq_overhead_s=0.0,
                   prefill_token_overhead_s=0.0, **fields)
    table = {}
    for quant, kv in calibrated_formats(config):
        measured = _engine_times(reference, config, quant, kv)
        table[f"{quant}/{kv}"] = _fit(config, base, measured, quant, kv)
    default = default_quantization(config)
    fields.update(table[f"{default}/bfloat16"], **{FORMAT_KEYS: table})
    logger.info("calibrated this machine on %s: %s", reference, fields)
    return fields


def _engine_times(reference: str, config: ModelConfig, quantization: str,
                  kv_dtype: str) -> dict:
    """Seconds per decode step at batch 1 and CALIBRATION_BATCH, and one lone prompt's TTFT,
    in one weight format and KV dtype, as served: `kvserve serve` streaming to a client, so
    the API server's share of the two cores (tokenizing, detokenizing, SSE) is in them."""
    import asyncio

    from kvserve.bench.plan.predict import Candidate
    from kvserve.bench.plan.validate import Deployment, _start, _stop

    kv = "auto" if kv_dtype == "bfloat16" else kv_dtype
    deployment = Deployment("calibration", Candidate(1, 1, 1, "aggregated", quantization,
                                                     kv_dtype),
                            ("--quantization", quantization, "--kv-cache-dtype", kv))
    processes: list = []
    try:
        url = _start(reference, deployment, processes)
        return asyncio.run(_streamed_times(url, reference))
    finally:
        for process in reversed(processes):
            _stop(process)


async def _streamed_times(url: str, reference: str) -> dict:
    """The median of CALIBRATION_REPEATS: a lone 256-token prompt (its TTFT, then its
    tokens' spacing), a lone CALIBRATION_LONG_PROMPT-token prompt (its TTFT), and
    CALIBRATION_BATCH prompts of 64 sent at once (the spacing once every one of them has its
    first token). The median, not the best: the bench it predicts
    reports medians, and the best of a few runs on a shared VM is a lucky one. Each prompt a
    different slice of text: no prefix-cache hits."""
    import asyncio

    from kvserve.bench.cli import _tokenizer
    from kvserve.bench.client import BenchClient
    from kvserve.bench.workloads import TextSource

    source = TextSource(_tokenizer(reference), seed=0)
    client = BenchClient(url, reference)
    tokens = CALIBRATION_TOKENS
    try:
        await client.complete(source.take(CALIBRATION_PROMPT), tokens)  # warm
        ones = [await client.complete(source.take(CALIBRATION_PROMPT), tokens)
                for _ in range(CALIBRATION_REPEATS)]
        longs = [await client.complete(source.take(CALIBRATION_LONG_PROMPT), 1)
                 for _ in range(CALIBRATION_REPEATS)]
        waves = [await asyncio.gather(*(client.complete(source.take(64), tokens)
                                        for _ in range(CALIBRATION_BATCH)))
                 for _ in range(CALIBRATION_REPEATS)]
    finally:
        await client.close()
    for result in [*ones, *(r for wave in waves for r in wave)]:
        if result.error or len(result.chunk_times) < 2:
            raise RuntimeError(f"calibration request failed: {result.error or 'no tokens'}")
    if any(r.error or r.first_token is None for r in longs):
        raise RuntimeError("calibration request failed: the long prompt")
    return {"ttft_s": median(r.first_token - r.sent for r in ones),
            "ttft_long_s": median(r.first_token - r.sent for r in longs),
            "step_1_s": median(_spacing(r.chunk_times[0], r.chunk_times[-1]) for r in ones),
            f"step_{CALIBRATION_BATCH}_s": median(
                _spacing(max(r.first_token for r in wave), max(r.chunk_times[-1] for r in wave))
                for wave in waves)}


def _spacing(first_s: float, last_s: float) -> float:
    return (last_s - first_s) / (CALIBRATION_TOKENS - 1)


def _fit(config: ModelConfig, base: Hardware, measured: dict, quant: str | None = None,
         kv_dtype: str = "bfloat16") -> dict:
    """Overheads = measured minus the roofline's time for the same work in the same format
    (default: the model's default weights): a line through the two decode batches, and one
    through the two lone prefills (its slope per token, the rest per step)."""
    from kvserve.bench.plan.cost import plan_cost
    from kvserve.bench.plan.predict import Candidate, InstanceModel, compute_dtype
    from kvserve.bench.plan.search import weight_format

    quant = quant or default_quantization(config)
    model = InstanceModel(config, plan_cost(config, weight_format(config, base, quant),
                                            kv_dtype), base,
                          Candidate(1, 1, 1, "aggregated", quant, kv_dtype),
                          compute_dtype(base, quant))
    roof_one = _roof(model.decode_step(1, CALIBRATION_PROMPT + CALIBRATION_TOKENS / 2))
    roof_many = _roof(model.decode_step(CALIBRATION_BATCH, 64 + CALIBRATION_TOKENS / 2))
    excess_one = max(0.0, measured["step_1_s"] - roof_one)
    excess_many = max(excess_one, measured[f"step_{CALIBRATION_BATCH}_s"] - roof_many)
    per_seq = (excess_many - excess_one) / (CALIBRATION_BATCH - 1)
    fixed = max(0.0, excess_one - per_seq)
    short, long = CALIBRATION_PROMPT, CALIBRATION_LONG_PROMPT
    excess_short = max(0.0, measured["ttft_s"] - fixed - _roof(model.prefill(short, short)))
    excess_long = max(excess_short,
                      measured["ttft_long_s"] - fixed - _roof(model.prefill(long, long)))
    per_token = (excess_long - excess_short) / (long - short)
    return dict(step_overhead_s=fixed, seq_overhead_s=per_seq,
                prefill_step_overhead_s=max(0.0, excess_short - short * per_token),
                prefill_token_overhead_s=per_token)


def _roof(times) -> float:
    return max(times.memory_s, times.compute_s)


def default_quantization(config: ModelConfig) -> str:
    """The engine's default weight format for this model here (a GGUF's own blocks, else
    dense), in the planner's names."""
    from kvserve.bench import roofline

    quant = roofline.engine_quantization(config, roofline.engine_dtype())
    return quant if quant in ("gguf", "none") else "none"
