"""`--hardware this`: this machine's roof (kvserve.bench.roofline.measure_roof) and the
engine's overheads, measured once per machine, model and kernel level and cached: a decode
step's fixed and per-sequence cost, a prefill's per-step and per-token cost beyond the
roofline's time, and a request's path through the API server.

They are measured for each weight format (and int8 KV) the engine runs here, as
AIConfigurator keeps a table of kernel times per quantization: the formats run different
kernels (a GGUF block dequantizes in its GEMM, int4 goes through AMX int8 where the CPU has
it), which the roofline's bytes and FLOPs alone do not price. Each is fitted on a server in
that format (lone prompts, then 8 short prompts at once; prefills timed in the engine core),
so the API server's share of the cores is in it; the deployments as the bench loads them (a closed
loop of clients whose prompts meet in the token budget, other lengths, replicas, P/D) are
predicted from these, never fitted on a candidate's own run."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from dataclasses import replace
from statistics import median

from kvserve.bench.plan.hardware import CPU_2CORE, Hardware
from kvserve.config import ModelConfig

logger = logging.getLogger(__name__)

CALIBRATION_PROMPT = 256  # the batch-1 decode's prompt (its context)
CALIBRATION_BATCH = 8  # the second decode batch (prompts of 64)
CALIBRATION_TOKENS = 33
CALIBRATION_REPEATS = 5
# lone prompts, each one step of the CPU's 512-token budget, timed in the engine core: a line
# through them splits a prefill's cost into a part per step and a part per token
PREFILL_LENGTHS = (64, 128, 256, 448)
LEDGER_STEPS = "kvserve:engine_steps_total"
LEDGER_SECONDS = "kvserve:engine_step_seconds_total"
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
        if "request_overhead_s" in fields:  # an older cache's fields: measured again
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
                     "steps at batch 1 and 8, lone prefills of 64-448 tokens timed in the "
                     "engine core (kvserve.bench.plan.calibrate)",
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
        table[f"{quant}/{kv}"] = fit_overheads(config, base, measured, quant, kv)
    default = default_quantization(config)
    fields.update(table[f"{default}/bfloat16"], **{FORMAT_KEYS: table})
    logger.info("calibrated this machine on %s: %s", reference, fields)
    return fields


def _engine_times(reference: str, config: ModelConfig, quantization: str,
                  kv_dtype: str) -> dict:
    """The calibration's measurements (served_times) on a fresh `kvserve serve` in one
    weight format and KV dtype."""
    from kvserve.bench.plan.predict import Candidate
    from kvserve.bench.plan.serving import Deployment, start, stop

    kv = "auto" if kv_dtype == "bfloat16" else kv_dtype
    deployment = Deployment("calibration", Candidate(1, 1, 1, "aggregated", quantization,
                                                     kv_dtype),
                            ("--quantization", quantization, "--kv-cache-dtype", kv))
    processes: list = []
    try:
        return served_times(start(reference, deployment, processes), reference)
    finally:
        for process in reversed(processes):
            stop(process)


def served_times(url: str, reference: str) -> dict:
    """Measured on a running server, as served: `kvserve serve` streaming to a client, so the
    API server's share of the two cores (tokenizing, detokenizing, SSE) is in them."""
    import asyncio

    return asyncio.run(_streamed_times(url, reference))


@asynccontextmanager
async def _calibration_client(url: str, reference: str, seed: int):
    """A bench client of the server at `url` and a source of text slices in `reference`'s
    tokens (each slice different, so no prompt hits the prefix cache); the client closed
    after."""
    from kvserve.bench.cli import _tokenizer
    from kvserve.bench.client import BenchClient
    from kvserve.bench.workloads import TextSource

    client = BenchClient(url, reference)
    try:
        yield client, TextSource(_tokenizer(reference), seed=seed)
    finally:
        await client.close()


async def _streamed_times(url: str, reference: str) -> dict:
    """The median of CALIBRATION_REPEATS of each: a lone 256-token prompt's tokens' spacing
    (a decode step at batch 1), lone prompts of each PREFILL_LENGTHS (their step's time in the
    engine core, from its step ledger, and the client's TTFT beyond it: the API server's path),
    and CALIBRATION_BATCH prompts of 64 sent at once (the spacing once every one of them has
    its first token). The median, not the best: the bench it predicts reports medians, and the
    best of a few runs on a shared VM is a lucky one. Each prompt a different slice of text: no
    prefix-cache hits."""
    import asyncio

    tokens = CALIBRATION_TOKENS
    async with _calibration_client(url, reference, seed=0) as (client, source):
        await client.complete(source.take(CALIBRATION_PROMPT), tokens)  # warm
        ones = [await client.complete(source.take(CALIBRATION_PROMPT), tokens)
                for _ in range(CALIBRATION_REPEATS)]
        prefills = {n: [await _lone_prefill(client, source.take(n))
                        for _ in range(CALIBRATION_REPEATS)] for n in PREFILL_LENGTHS}
        waves = [await asyncio.gather(*(client.complete(source.take(64), tokens)
                                        for _ in range(CALIBRATION_BATCH)))
                 for _ in range(CALIBRATION_REPEATS)]
    for result in [*ones, *(r for wave in waves for r in wave)]:
        if result.error or len(result.chunk_times) < 2:
            raise RuntimeError(f"calibration request failed: {result.error or 'no tokens'}")
    return {"step_1_s": median(_spacing(r.chunk_times[0], r.chunk_times[-1]) for r in ones),
            f"step_{CALIBRATION_BATCH}_s": median(
                _spacing(max(r.first_token for r in wave), max(r.chunk_times[-1] for r in wave))
                for wave in waves),
            "prefill_s": {str(n): median(engine for engine, _ in runs)
                          for n, runs in prefills.items()},
            "request_s": median(max(0.0, ttft - engine) for runs in prefills.values()
                                for engine, ttft in runs)}


def lone_ttft(url: str, reference: str, prompt_len: int = CALIBRATION_PROMPT) -> float:
    """The median client TTFT of CALIBRATION_REPEATS lone prompts of `prompt_len` tokens (two
    tokens asked: a P/D pair's first token comes from its decode side), after one to warm."""
    import asyncio

    async def measure() -> float:
        async with _calibration_client(url, reference, seed=1) as (client, source):
            results = [await client.complete(source.take(prompt_len), 2)
                       for _ in range(CALIBRATION_REPEATS + 1)][1:]
        if any(r.error or r.first_token is None for r in results):
            raise RuntimeError("calibration request failed: a lone prompt")
        return median(r.first_token - r.sent for r in results)

    return asyncio.run(measure())


async def _lone_prefill(client, prompt: str) -> tuple[float, float]:
    """(seconds of the prompt's one engine step, the client's TTFT) of a one-token request:
    the step ledger's counters read before and after it."""
    import asyncio

    before = await _ledger(client)
    result = await client.complete(prompt, 1)
    if result.error or result.first_token is None:
        raise RuntimeError(f"calibration request failed: {result.error or 'no token'}")
    for _ in range(50):  # the stats come with the step's output; a scrape may race them
        after = await _ledger(client)
        if after[0] > before[0]:
            steps, seconds = after[0] - before[0], after[1] - before[1]
            return seconds / steps, result.first_token - result.sent
        await asyncio.sleep(0.02)
    raise RuntimeError("calibration: the server's step ledger did not count the prefill "
                       "(is it running with --no-step-ledger?)")


async def _ledger(client) -> tuple[float, float]:
    """(steps, seconds) the engine core has counted: its /metrics counters."""
    from kvserve.router.replicas import parse_metrics

    response = await client.http.get("/metrics")
    response.raise_for_status()
    values = parse_metrics(response.text)
    return values.get(LEDGER_STEPS, 0.0), values.get(LEDGER_SECONDS, 0.0)


def _spacing(first_s: float, last_s: float) -> float:
    return (last_s - first_s) / (CALIBRATION_TOKENS - 1)


def fit_overheads(config: ModelConfig, base: Hardware, measured: dict,
                  quant: str | None = None, kv_dtype: str = "bfloat16") -> dict:
    """Overheads = measured minus the roofline's time for the same work in the same format
    (default: the model's default weights): a line through the two decode batches, and a
    least-squares line through the lone prefills (its slope per token, the rest, less the
    decode's fixed part, per step)."""
    from kvserve.bench.plan.predict import Candidate
    from kvserve.bench.plan.search import instance_model

    quant = quant or default_quantization(config)
    model = instance_model(config, base, Candidate(1, 1, 1, "aggregated", quant, kv_dtype))
    roof_one = _roof(model.decode_step(1, CALIBRATION_PROMPT + CALIBRATION_TOKENS / 2))
    roof_many = _roof(model.decode_step(CALIBRATION_BATCH, 64 + CALIBRATION_TOKENS / 2))
    excess_one = max(0.0, measured["step_1_s"] - roof_one)
    excess_many = max(excess_one, measured[f"step_{CALIBRATION_BATCH}_s"] - roof_many)
    per_seq = (excess_many - excess_one) / (CALIBRATION_BATCH - 1)
    fixed = max(0.0, excess_one - per_seq)
    lengths = [int(n) for n in measured["prefill_s"]]
    excess = [measured["prefill_s"][str(n)] - _roof(model.prefill(n, n)) for n in lengths]
    per_step, per_token = _line(lengths, excess)
    return dict(step_overhead_s=fixed, seq_overhead_s=per_seq,
                prefill_step_overhead_s=max(0.0, per_step - fixed),
                prefill_token_overhead_s=per_token, request_overhead_s=measured["request_s"])


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x with a, b >= 0 (an excess is never negative)."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    slope = max(0.0, slope)
    intercept = mean_y - slope * mean_x
    if intercept < 0.0:  # through the origin instead
        slope, intercept = max(0.0, sum(x * y for x, y in zip(xs, ys))
                               / sum(x * x for x in xs)), 0.0
    return intercept, slope


def _roof(times) -> float:
    return max(times.memory_s, times.compute_s)


def default_quantization(config: ModelConfig) -> str:
    """The engine's default weight format for this model here (a GGUF's own blocks, else
    dense), in the planner's names."""
    from kvserve.bench import roofline

    quant = roofline.engine_quantization(config, roofline.engine_dtype())
    return quant if quant in ("gguf", "none") else "none"
