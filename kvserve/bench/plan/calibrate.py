"""`--hardware this`: this machine's roof (kvserve.bench.roofline.measure_roof) and the
engine's overheads, measured once per machine, model and kernel level and cached: a decode
step's fixed and per-sequence cost and a prefill's per-token cost beyond the roofline's time,
fitted on the model's default format at two batch sizes (never on a candidate's own run)."""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import replace

from kvserve.bench.plan.hardware import CPU_2CORE, Hardware
from kvserve.config import ModelConfig

logger = logging.getLogger(__name__)

CALIBRATION_PROMPT = 256  # the single prefill measured, and the batch-1 decode's context
CALIBRATION_BATCH = 8  # the second decode batch (prompts of 64)
CALIBRATION_TOKENS = 33


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
        return replace(_base(), **fields)
    fields = measure(reference, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields, indent=1))
    return replace(_base(), **fields)


def _base() -> Hardware:
    return replace(CPU_2CORE, name="this", sources={
        "memory_gbps": "measured now (kvserve.bench.roofline.measure_memory_bandwidth)",
        "gflops": "measured now at the model's MLP shape (measure_roof)",
        "overheads": "measured now: engine steps of the model's default format at batch 1 "
                     "and 8, one 256-token prefill (kvserve.bench.plan.calibrate)",
        **{k: v for k, v in CPU_2CORE.sources.items()
           if k in ("memory_fraction", "engine_overhead_bytes")}})


def _memory_bytes() -> float:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    return CPU_2CORE.memory_bytes


def measure(reference: str, config: ModelConfig) -> dict:
    """The roof now, then the engine's overheads on the model's default format."""
    from kvserve.bench import roofline

    roof = roofline.measure_roof(config)
    gemm = roofline.roof_gemm_dtype("bfloat16", roof.native_bf16)
    fields = dict(memory_gbps=roof.memory_gbps, memory_bytes=_memory_bytes(),
                  gflops={"bfloat16": roof.gemm_gflops[gemm],
                          "float32": roof.gemm_gflops["float32"]})
    base = replace(_base(), step_overhead_s=0.0, seq_overhead_s=0.0,
                   prefill_token_overhead_s=0.0, **fields)
    measured = _engine_times(reference, config)
    fields.update(_fit(config, base, measured))
    logger.info("calibrated this machine on %s: %s", reference, fields)
    return fields


def _engine_times(reference: str, config: ModelConfig) -> dict:
    """Seconds per decode step at batch 1 and CALIBRATION_BATCH, and one prefill's TTFT."""
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine_config import EngineConfig

    engine = LLMEngine(EngineConfig(model=reference, enable_prefix_caching=False),
                       warm_up=True)
    try:
        rng = random.Random(0)
        one = [[rng.randrange(100, config.vocab_size - 100) for _ in range(CALIBRATION_PROMPT)]]
        many = [[rng.randrange(100, config.vocab_size - 100) for _ in range(64)]
                for _ in range(CALIBRATION_BATCH)]
        _timed(engine, one, "warm")
        ttft, step_one = min(_timed(engine, one, f"one{i}") for i in range(2))
        _, step_many = min(_timed(engine, many, f"many{i}") for i in range(2))
    finally:
        engine.shutdown()
    return {"ttft_s": ttft, "step_1_s": step_one, f"step_{CALIBRATION_BATCH}_s": step_many}


def _timed(engine, prompts: list[list[int]], tag: str) -> tuple[float, float]:
    """(first request's TTFT, seconds per decode step once every request has its first
    token): decode time over tokens, whatever steps the engine groups them in."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=CALIBRATION_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = time.perf_counter()
    done = time.perf_counter()
    all_first = max(first.values())
    return min(first.values()) - start, (done - all_first) / (CALIBRATION_TOKENS - 1)


def _fit(config: ModelConfig, base: Hardware, measured: dict) -> dict:
    """Overheads = measured minus the roofline's time for the same work, in the default
    format: a line through the two decode batches, the prefill's excess per token."""
    from kvserve.bench.plan.cost import plan_cost
    from kvserve.bench.plan.predict import Candidate, InstanceModel, compute_dtype
    from kvserve.bench.plan.search import weight_format

    quant = default_quantization(config)
    model = InstanceModel(config, plan_cost(config, weight_format(config, base, quant),
                                            "bfloat16"), base,
                          Candidate(1, 1, 1, "aggregated", quant, "bfloat16"),
                          compute_dtype(base, quant))
    roof_one = _roof(model.decode_step(1, CALIBRATION_PROMPT + CALIBRATION_TOKENS / 2))
    roof_many = _roof(model.decode_step(CALIBRATION_BATCH, 64 + CALIBRATION_TOKENS / 2))
    excess_one = max(0.0, measured["step_1_s"] - roof_one)
    excess_many = max(excess_one, measured[f"step_{CALIBRATION_BATCH}_s"] - roof_many)
    per_seq = (excess_many - excess_one) / (CALIBRATION_BATCH - 1)
    fixed = max(0.0, excess_one - per_seq)
    prefill_roof = _roof(model.prefill(CALIBRATION_PROMPT, CALIBRATION_PROMPT))
    per_token = max(0.0, (measured["ttft_s"] - fixed - prefill_roof) / CALIBRATION_PROMPT)
    return dict(step_overhead_s=fixed, seq_overhead_s=per_seq,
                prefill_token_overhead_s=per_token)


def _roof(times) -> float:
    return max(times.memory_s, times.compute_s)


def default_quantization(config: ModelConfig) -> str:
    """The engine's default weight format for this model here (a GGUF's own blocks, else
    dense), in the planner's names."""
    from kvserve.bench import roofline

    quant = roofline.engine_quantization(config, roofline.engine_dtype())
    return quant if quant in ("gguf", "none") else "none"
