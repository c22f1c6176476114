"""Enumerate deployment candidates for a model on a hardware profile, predict each at the
largest concurrency its KV capacity and the SLOs allow, and pick one with the reason in
words."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.bench import roofline
from kvserve.bench.plan.cost import plan_cost
from kvserve.bench.plan.hardware import Hardware
from kvserve.bench.plan.predict import (
    MAX_NUM_SEQS,
    SLO,
    Candidate,
    InstanceModel,
    Latency,
    Workload,
    aggregated,
    compute_dtype,
    disaggregated,
)
from kvserve.config import ModelConfig

# GPU weight layouts as vLLM serves them: fp8 and int8 one byte per weight (per-channel or
# 128x128 block scales, < 1%), int4 GPTQ/AWQ groups of 128 with fp16 scale and zero; the LM
# head stays bf16
GPU_BYTES_PER_WEIGHT = {"none": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / 128}


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    weight_bytes_per_device: float
    kv_capacity_tokens: int  # per instance (a decode instance when disaggregated)
    kv_bytes: float  # KV memory per instance (on a CPU: its --kv-cache-memory-bytes)
    kv_limit_batch: int  # sequences of the workload's length an instance holds
    batch: int  # per instance at the chosen concurrency (0: nothing meets the SLOs)
    latency: Latency | None
    limited_by: str  # what stopped the concurrency from growing
    fits: bool

    @property
    def concurrency(self) -> int:
        cand = self.candidate
        serving = cand.decode_instances if cand.mode == "disaggregated" else cand.instances
        return self.batch * serving * cand.pp

    @property
    def meets_slo(self) -> bool:
        return self.fits and self.batch > 0


def weight_format(config: ModelConfig, hardware: Hardware, quantization: str
                  ) -> roofline.WeightFormat:
    """The bytes a weight takes: the engine's own layouts on a CPU (the roofline's), vLLM's
    on a GPU."""
    if hardware.kind == "cpu":
        return roofline.weight_format("bfloat16", quantization, config.source_weight_type)
    layer = GPU_BYTES_PER_WEIGHT[quantization]
    return roofline.WeightFormat("bfloat16", quantization, layer, 2.0)


def candidates(hardware: Hardware, devices: int, quantizations: tuple[str, ...],
               kv_dtypes: tuple[str, ...], dp_attention: bool = False) -> list[Candidate]:
    """TP within a node, PP across what is left, instances (replicas, or prefill and decode
    groups) over the devices; on a single CPU, one or two engines sharing it; with
    `dp_attention` (MLA mixtures), each TP group also as DP attention plus EP."""
    layouts = []
    if hardware.kind == "cpu" and devices == 1:
        layouts = [(1, 1, 1, "aggregated", 0, 1.0), (1, 1, 2, "aggregated", 0, 0.5),
                   (1, 1, 2, "disaggregated", 1, 0.5)]
    else:
        for tp in _powers_of_two(min(devices, hardware.devices_per_node)):
            for pp in _powers_of_two(devices // tp):
                instances = devices // (tp * pp)
                layouts.append((tp, pp, instances, "aggregated", 0, 1.0))
                for prefill in range(1, instances):
                    layouts.append((tp, pp, instances, "disaggregated", prefill, 1.0))
    plain = [Candidate(tp, pp, n, mode, quant, kv, prefill, share)
             for tp, pp, n, mode, prefill, share in layouts
             for quant in quantizations for kv in kv_dtypes]
    if not dp_attention:
        return plain
    return plain + [replace(c, dp_attention=True) for c in plain if c.tp > 1]


def _powers_of_two(limit: int) -> list[int]:
    values, value = [], 1
    while value <= limit:
        values.append(value)
        value *= 2
    return values


def instance_model(config: ModelConfig, hardware: Hardware,
                   candidate: Candidate) -> InstanceModel:
    """One engine instance of the candidate on the hardware, in its weight and KV formats."""
    fmt = weight_format(config, hardware, candidate.quantization)
    return InstanceModel(config, plan_cost(config, fmt, candidate.kv_dtype), hardware,
                         candidate, compute_dtype(hardware, candidate.quantization))


def predict(config: ModelConfig, hardware: Hardware, candidate: Candidate,
            workload: Workload, slo: SLO, batch: int | None = None,
            max_num_seqs: int = MAX_NUM_SEQS) -> Prediction:
    """The candidate at `batch` sequences per instance, or at the most the SLOs allow."""
    model = instance_model(config, hardware, candidate)
    cost = model.cost
    devices = candidate.tp * candidate.pp
    weights_per_device = model.resident_bytes_per_device()
    # each device: its share of usable memory, less the engine's overhead and its weights
    usable = devices * (hardware.memory_bytes * hardware.memory_fraction * candidate.share
                        - hardware.engine_overhead_bytes - weights_per_device)
    context = workload.input_len + workload.output_len
    full = cost.kv_bytes_per_sequence(context) * model.kv_replication
    capacity = max(0, int(usable * context / full))
    kv_batch = max(0, int(usable / full))
    # pp micro-batches of `batch` sequences each are in flight in one instance's KV
    # (DP attention: each rank schedules its own up to max_num_seqs)
    seqs = max_num_seqs * (candidate.tp if candidate.dp_attention else 1)
    limit = min(kv_batch // candidate.pp, seqs)
    fits = limit >= 1

    def run(b: int) -> Latency:
        if candidate.mode == "disaggregated":
            return disaggregated(model, model, workload, b, seqs)
        return aggregated(model, workload, b, seqs)

    base = dict(candidate=candidate, weight_bytes_per_device=weights_per_device,
                kv_capacity_tokens=capacity, kv_bytes=max(0.0, usable),
                kv_limit_batch=kv_batch, fits=fits)
    if not fits:
        return Prediction(batch=0, latency=None, limited_by="memory: weights do not fit"
                          if usable <= 0 else "memory: not one sequence's KV", **base)
    if batch is not None:
        return Prediction(batch=batch, latency=run(batch), limited_by="given", **base)
    best, reason = _largest_batch(run, slo, limit, workload.arrival == "closed")
    reason = reason or ("KV capacity" if limit < seqs else "max_num_seqs")
    if best == 0:
        return Prediction(batch=0, latency=run(1), limited_by=reason, **base)
    return Prediction(batch=best, latency=run(best), limited_by=reason, **base)


def _largest_batch(run, slo: SLO, limit: int, bisect: bool) -> tuple[int, str | None]:
    """The largest batch up to `limit` whose latency meets the SLOs, and the SLO that stopped
    it (None: none did). Step by step for the formulas; by bisection for the closed-loop
    simulation (its cost grows with the batch; its latencies grow with it too)."""
    if not bisect:
        for b in range(1, limit + 1):
            latency = run(b)
            if not slo.met(latency.ttft_s, latency.tpot_s):
                return b - 1, _slo_reason(slo, latency)
        return limit, None
    low, high, reason = 0, limit, None  # low meets (0: vacuously), above high fails
    while low < high:
        middle = (low + high + 1) // 2
        latency = run(middle)
        if slo.met(latency.ttft_s, latency.tpot_s):
            low = middle
        else:
            high, reason = middle - 1, _slo_reason(slo, latency)
    return low, reason


def _slo_reason(slo: SLO, latency: Latency) -> str:
    if slo.tpot_ms is not None and latency.tpot_s * 1e3 > slo.tpot_ms:
        return "TPOT SLO"
    return "TTFT SLO"


def recommend(predictions: list[Prediction]) -> Prediction | None:
    """The highest throughput meeting the SLOs; ties (within 2%) go to fewer lossy choices
    (bf16 weights and KV first), then to fewer devices."""
    feasible = [p for p in predictions if p.meets_slo]
    if not feasible:
        return None
    top = max(p.latency.throughput for p in feasible)
    close = [p for p in feasible if p.latency.throughput >= 0.98 * top]
    return min(close, key=lambda p: (_lossiness(p.candidate), p.candidate.devices,
                                     -p.latency.throughput))


def _lossiness(candidate: Candidate) -> int:
    weights = {"none": 0, "gguf": 0, "fp8": 1, "int8": 1, "int4": 2}.get(
        candidate.quantization, 1)
    return weights + (0 if candidate.kv_dtype in ("bfloat16", "float32") else 1)


def reason(best: Prediction, predictions: list[Prediction], workload: Workload) -> str:
    """Why this one, in words: the bound at its batch, what caps its concurrency, and what
    each of its choices gains over the best candidate that differs from it in only that."""
    cand, lat = best.candidate, best.latency
    parts = [f"{cand.label()} {cand.mode}, weights {cand.quantization}, KV {cand.kv_dtype}: "
             f"decode is {lat.bound}-bound at batch {best.batch} per instance; concurrency "
             f"{best.concurrency} is capped by {best.limited_by}"]
    for field, baseline in (("kv_dtype", _baseline_kv(predictions, cand)),
                            ("quantization", "none"), ("mode", "aggregated")):
        if baseline is None or getattr(cand, field) == baseline:
            continue
        other = _twin(predictions, replace(cand, **{field: baseline}))
        if other is None or not other.meets_slo:  # then the best of any layout
            other = max((p for p in predictions if p.meets_slo
                         and getattr(p.candidate, field) == baseline),
                        key=lambda p: p.latency.throughput, default=None)
        if other is None:
            parts.append(f"no candidate with {field.replace('_', ' ')} {baseline} meets "
                         f"the SLOs")
            continue
        parts.append(f"{getattr(cand, field)} over {baseline} ({other.candidate.label()}): "
                     f"{best.concurrency} against {other.concurrency} sequences, "
                     f"{lat.throughput / other.latency.throughput:.2f}x the throughput")
    return "; ".join(parts)


def _baseline_kv(predictions: list[Prediction], cand: Candidate) -> str | None:
    return "bfloat16" if cand.kv_dtype != "bfloat16" else None


def _twin(predictions: list[Prediction], wanted: Candidate) -> Prediction | None:
    return next((p for p in predictions if p.candidate == wanted), None)
