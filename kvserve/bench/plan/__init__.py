"""`kvserve plan`: pick a deployment (TP/PP/replicas, aggregated or disaggregated, weight and
KV formats) for a model, hardware and SLOs before anything runs, from the roofline and the
engine's overheads; `--validate` measures the candidates this machine can run
(docs/planner.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI's parser imports this package: no torch (the roofline) until a plan
    from kvserve.bench.plan.hardware import Hardware
    from kvserve.bench.plan.predict import SLO, Workload
    from kvserve.config import ModelConfig


def make_plan(model: str, config: ModelConfig, hardware: Hardware, devices: int,
              workload: Workload, slo: SLO, quantizations: tuple[str, ...] | None = None,
              kv_dtypes: tuple[str, ...] | None = None, max_num_seqs: int = 256) -> dict:
    """Every candidate predicted at its best SLO-meeting concurrency, and the pick."""
    from kvserve.bench import roofline
    from kvserve.bench.plan.cost import plan_cost
    from kvserve.bench.plan.report import model_shape, plan_dict
    from kvserve.bench.plan.search import candidates, predict, reason, recommend

    quantizations = quantizations or _quantizations(config, hardware)
    predictions = [predict(config, hardware, cand, workload, slo, max_num_seqs=max_num_seqs)
                   for cand in candidates(hardware, devices, quantizations,
                                          kv_dtypes or hardware.kv_dtypes,
                                          bool(config.kv_lora_rank and config.num_experts))]
    best = recommend(predictions)
    why = reason(best, predictions, workload) if best is not None else ""
    bf16 = plan_cost(config, roofline.weight_format("bfloat16", "none"), "bfloat16")
    return plan_dict(model, model_shape(config, bf16.resident_weight_bytes), hardware, devices,
                     workload, slo, predictions, best, why)


def _quantizations(config: ModelConfig, hardware: Hardware) -> tuple[str, ...]:
    """The hardware's formats, plus a GGUF's own blocks on a CPU (the engine's default)."""
    from kvserve.kernels.reference import GGUF_FORMATS

    if hardware.kind == "cpu" and config.source_weight_type in GGUF_FORMATS:
        return ("gguf", *hardware.quantizations)
    return hardware.quantizations
