"""A plan as a terminal table and as JSON (`kvserve plan --json`)."""

from __future__ import annotations

from dataclasses import asdict

from kvserve.bench.plan.cost import kv_row_values
from kvserve.bench.plan.hardware import Hardware
from kvserve.bench.plan.predict import SLO, Workload, candidate_dict
from kvserve.bench.plan.search import Prediction
from kvserve.config import ModelConfig

COLUMNS = ("deployment", "mode", "weights", "KV", "KV tokens/inst", "conc", "TTFT ms",
           "TPOT ms", "tok/s", "tok/s/dev", "bound", "limited by")


def model_shape(config: ModelConfig, resident_bf16_bytes: float) -> dict:
    """The shape fields the plan rests on (docs/planner.md tabulates them)."""
    rows, row_values = kv_row_values(config)
    shape = {"architecture": config.architecture, "layers": config.num_hidden_layers,
             "hidden": config.hidden_size, "heads": config.num_attention_heads,
             "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
             "vocab": config.vocab_size, "kv_rows_per_token_layer": rows,
             "kv_values_per_row": row_values,
             "params_billion": resident_bf16_bytes / 2 / 1e9}
    if config.num_experts:
        shape.update(experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                     moe_intermediate=config.moe_intermediate_size,
                     shared_intermediate=config.shared_expert_intermediate_size)
    if config.kv_lora_rank:
        shape.update(kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.head_dim,
                     q_lora_rank=config.q_lora_rank)
    return shape


def prediction_dict(prediction: Prediction) -> dict:
    latency = prediction.latency
    row = {"candidate": candidate_dict(prediction.candidate), "fits": prediction.fits,
           "meets_slo": prediction.meets_slo,
           "weight_gb_per_device": prediction.weight_bytes_per_device / 1e9,
           "kv_capacity_tokens": prediction.kv_capacity_tokens,
           "kv_gb_per_instance": prediction.kv_bytes / 1e9,
           "kv_limit_batch": prediction.kv_limit_batch,
           "batch_per_instance": prediction.batch, "concurrency": prediction.concurrency,
           "limited_by": prediction.limited_by}
    if latency is not None:
        row.update(ttft_ms=latency.ttft_s * 1e3, tpot_ms=latency.tpot_s * 1e3,
                   throughput_tok_s=latency.throughput,
                   throughput_per_device_tok_s=latency.throughput
                   / prediction.candidate.devices, bound=latency.bound)
    return row


def serve_command(model: str, prediction: Prediction, kind: str) -> str:
    """The `kvserve serve` line(s) of a candidate (vLLM's flag names). DP attention has no
    engine switch yet: its line is TP plus expert parallelism. On a CPU the KV pool is sized
    by bytes (the engine's default is 1 GiB), so the line names the planned pool."""
    cand = prediction.candidate
    flags = [f"kvserve serve --model {model}"]
    if cand.quantization not in ("none",):
        flags.append(f"--quantization {cand.quantization}")
    flags.append(f"--kv-cache-dtype {cand.kv_dtype}")
    if kind == "cpu":
        flags.append(f"--kv-cache-memory-bytes {int(prediction.kv_bytes)}")
    if cand.tp > 1:
        flags.append(f"--tensor-parallel-size {cand.tp}")
    if cand.pp > 1:
        flags.append(f"--pipeline-parallel-size {cand.pp}")
    if cand.dp_attention:
        flags.append("--enable-expert-parallel")
    line = " ".join(flags)
    if cand.mode == "disaggregated":
        return (f"{cand.prefill_instances} x `{line} --kv-role prefill`, "
                f"{cand.decode_instances} x `{line} --kv-role decode`, behind "
                f"`kvserve router --prefill URL... --decode URL...`")
    if cand.instances > 1:
        return f"`{line} --replicas {cand.instances}`"
    return f"`{line}`"


def plan_dict(model: str, shape: dict, hardware: Hardware, devices: int, workload: Workload,
              slo: SLO, predictions: list[Prediction], best: Prediction | None,
              why: str) -> dict:
    return {"model": model, "shape": shape, "hardware": hardware.as_dict(),
            "devices": devices, "workload": asdict(workload), "slo": asdict(slo),
            "candidates": [prediction_dict(p) for p in predictions],
            "recommendation": None if best is None else
            dict(prediction_dict(best), reason=why, command=serve_command(model, best, hardware.kind))}


def table(plan: dict, limit: int = 25) -> str:
    """The best `limit` candidates by throughput (those meeting the SLOs first)."""
    rows = sorted(plan["candidates"], key=lambda r: (not r["meets_slo"],
                                                     -r.get("throughput_tok_s", 0)))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows[:limit]:
        lines.append("| " + " | ".join(_cells(row)) + " |")
    if len(rows) > limit:
        lines.append(f"({len(rows) - limit} more in --json)")
    return "\n".join(lines)


def _cells(row: dict) -> list[str]:
    cand = row["candidate"]
    if "ttft_ms" not in row:
        timing = ["-"] * 5
    else:
        timing = [f"{row['ttft_ms']:.0f}", f"{row['tpot_ms']:.1f}",
                  f"{row['throughput_tok_s']:.0f}" if row["meets_slo"] else "-",
                  f"{row['throughput_per_device_tok_s']:.0f}" if row["meets_slo"] else "-",
                  row["bound"]]
    return [cand["label"], cand["mode"][:5], cand["quantization"], cand["kv_dtype"],
            f"{row['kv_capacity_tokens']:,}", str(row["concurrency"]), *timing,
            row["limited_by"]]


def summary(plan: dict) -> str:
    best = plan["recommendation"]
    workload, slo = plan["workload"], plan["slo"]
    head = (f"plan: {plan['model']} on {plan['devices']} x {plan['hardware']['name']}; "
            f"input {workload['input_len']}, output {workload['output_len']}, prefix share "
            f"{workload['prefix_share']:.0%}, {workload['arrival']} arrivals; SLO TTFT "
            f"{slo['ttft_ms']} ms, TPOT {slo['tpot_ms']} ms")
    if best is None:
        fits = any(r["fits"] for r in plan["candidates"])
        return head + ("\nno candidate meets the SLOs" if fits else
                       "\nthe model does not fit: no candidate holds its weights and one "
                       "sequence's KV on this hardware")
    return (head + f"\nrecommended: {best['candidate']['label']} {best['candidate']['mode']}"
            f", weights {best['candidate']['quantization']}, KV {best['candidate']['kv_dtype']}"
            f": {best['throughput_tok_s']:.0f} tok/s at concurrency {best['concurrency']}, "
            f"TTFT {best['ttft_ms']:.0f} ms, TPOT {best['tpot_ms']:.1f} ms\nwhy: "
            f"{best['reason']}\nrun: {best['command']}")
