"""`kvserve plan --validate`: serve the candidates this machine can run, load each with
`kvserve bench serve` (a closed loop of --max-concurrency clients, simulated as one), and set
the measured TTFT, TPOT and throughput beside the predictions at the same concurrency.

With `--validate-calibration each` (the default) a single engine's overheads are calibrated on
its own server just before its bench (calibrate.py's lone prompts and short waves, never the
bench's closed loop): this VM drifts by 20% and more from one minute or process to the next,
which a cache measured earlier cannot follow, and the error left is then the model's.
Predictions are never adjusted to the bench's measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import astuple, replace
from pathlib import Path

from kvserve.bench.plan.calibrate import (
    default_quantization,
    fit_overheads,
    lone_ttft,
    served_times,
)
from kvserve.bench.plan.hardware import OVERHEAD_FIELDS, Hardware
from kvserve.bench.plan.predict import SLO, Candidate, Workload
from kvserve.bench.plan.search import instance_model, predict
from kvserve.bench.plan.serving import Deployment, start, stop
from kvserve.config import ModelConfig


def deployments(config: ModelConfig) -> list[Deployment]:
    """The default format, bf16 and int4 weights, int8 KV, two Ray Serve replicas, and one
    prefill plus one decode server behind the router."""
    default = default_quantization(config)
    base = Candidate(1, 1, 1, "aggregated", default, "bfloat16")
    rows = [Deployment(f"weights {default}", base, ("--quantization", default))]
    for quant in ("none", "int4"):
        if quant != default:
            rows.append(Deployment(f"weights {quant}", replace(base, quantization=quant),
                                   ("--quantization", quant)))
    rows.append(Deployment("KV int8", replace(base, kv_dtype="int8"),
                           ("--quantization", default, "--kv-cache-dtype", "int8")))
    rows.append(Deployment("2 replicas (Ray Serve)", replace(base, instances=2, share=0.5),
                           ("--quantization", default, "--replicas", "2")))
    # KV transfer moves whole block tables: a model with sliding windows keeps every block
    # (the engine's and vLLM's rule for P/D with hybrid KV)
    hybrid = ("--disable-hybrid-kv-cache-manager",) if any(
        window is not None for window in config.sliding_windows) else ()
    rows.append(Deployment("1P1D (router)", replace(base, instances=2, share=0.5,
                                                    mode="disaggregated",
                                                    prefill_instances=1),
                           ("--quantization", default, *hybrid)))
    return rows


def validate(args, config: ModelConfig, hardware: Hardware, workload: Workload,
             only: int | None = None) -> dict:
    """Each deployment measured and predicted; `only`: the first that many."""
    rows = []
    chosen = [d for d in deployments(config)
              if not getattr(args, "validate_only", None) or args.validate_only in d.name]
    for deployment in chosen[:only]:
        measured, overheads = _measure(args, config, hardware, deployment, workload)
        cand = deployment.candidate
        serving = cand.decode_instances if cand.mode == "disaggregated" else cand.instances
        batch = max(1, args.max_concurrency // serving)
        # the bench is a closed loop of fixed-length requests: predicted as one (simulate.py;
        # P/D keeps its formula), with each instance's share of the requests
        loop = replace(workload, arrival="closed",
                       requests=max(1, args.num_prompts // serving))
        priced = _with_overheads(hardware, cand, overheads) if overheads else hardware
        predicted = predict(config, priced, cand, loop, SLO(), batch=batch,
                            max_num_seqs=getattr(args, "max_num_seqs", 256)).latency
        row = _row(deployment, measured, predicted)
        row["calibration"] = ("the cache" if not overheads else "the cache and the pair's "
                              "handoff, before its bench" if cand.mode == "disaggregated"
                              else "this server, before its bench")
        if overheads:
            row["overheads"] = overheads
        rows.append(row)
    return {"load_average": os.getloadavg(), "num_prompts": args.num_prompts,
            "max_concurrency": args.max_concurrency, "workload": workload.__dict__,
            "repeats": max(1, getattr(args, "validate_repeats", 1)),
            "calibration": getattr(args, "validate_calibration", "each"),
            "deployments": rows,
            "within_20_percent": sum(r["all_within_20_percent"] for r in rows
                                     if "error" not in r)}


def calibrates_here(args, deployment: Deployment) -> bool:
    """Whether the deployment's own server is calibrated before its bench: a single engine
    (the calibration's lone prompts and waves measure one engine; replicas and P/D split
    them)."""
    cand = deployment.candidate
    return getattr(args, "validate_calibration", "each") == "each" and \
        cand.mode == "aggregated" and cand.instances == 1


def _measures_handoff(args, deployment: Deployment) -> bool:
    return getattr(args, "validate_calibration", "each") == "each" and \
        deployment.candidate.mode == "disaggregated"


def handoff_overheads(config: ModelConfig, hardware: Hardware, cand: Candidate,
                      measured_ttft_s: float, prompt_len: int) -> dict:
    """A P/D pair's per-request handoff (the router's second hop, the connectors' handshake
    and pull beyond the KV's bytes): a lone prompt's TTFT through the pair less what the
    model gives it without one. The rest are the cache's overheads of the pair's format."""
    base = dict(zip(OVERHEAD_FIELDS, astuple(hardware.overheads(cand.quantization,
                                                                 cand.kv_dtype))))
    base["kv_handoff_overhead_s"] = 0.0
    model = instance_model(config, hardware, cand)
    without = (model.mixed_step(0, prompt_len, 0.0, prompt_len).total_s
               + model.kv_transfer_s(prompt_len) + model.decode_step(1, prompt_len).total_s
               + model.overheads.request_s)
    return dict(base, kv_handoff_overhead_s=max(0.0, measured_ttft_s - without))


def _with_overheads(hardware: Hardware, cand: Candidate, overheads: dict) -> Hardware:
    table = dict(hardware.format_overheads)
    table[f"{cand.quantization}/{cand.kv_dtype}"] = overheads
    return replace(hardware, format_overheads=table)


def _row(deployment: Deployment, measured: dict, predicted) -> dict:
    row = {"name": deployment.name, "label": deployment.candidate.label(),
           "serve_args": list(deployment.serve_args)}
    if "error" in measured:
        return dict(row, error=measured["error"])
    pairs = {"ttft_ms": (predicted.ttft_s * 1e3, measured["ttft_ms"]),
             "tpot_ms": (predicted.tpot_s * 1e3, measured["tpot_ms"]),
             "throughput_tok_s": (predicted.throughput, measured["throughput_tok_s"])}
    for key, (pred, meas) in pairs.items():
        row[key] = {"predicted": pred, "measured": meas,
                    "error": (pred - meas) / meas if meas else None}
    row["all_within_20_percent"] = all(
        v["error"] is not None and abs(v["error"]) <= 0.2 for v in
        (row[k] for k in pairs))
    return dict(row, load_average=measured["load_average"],
                **({"runs": measured["runs"]} if "runs" in measured else {}))


def _measure(args, config: ModelConfig, hardware: Hardware, deployment: Deployment,
             workload: Workload) -> tuple[dict, dict | None]:
    """Start the deployment, calibrate it (calibrates_here; a P/D pair: its handoff), run the
    bench against it, stop it: (the bench's figures, the overheads fitted on it or None)."""
    processes: list[subprocess.Popen] = []
    overheads = None
    try:
        url = start(args.model, deployment, processes)
        cand = deployment.candidate
        if calibrates_here(args, deployment):
            overheads = fit_overheads(config, hardware, served_times(url, args.model),
                                      cand.quantization, cand.kv_dtype)
        elif _measures_handoff(args, deployment):
            overheads = handoff_overheads(config, hardware, cand,
                                          lone_ttft(url, args.model, workload.input_len),
                                          workload.input_len)
        # a new seed a run: the same prompts again would be prefix-cache hits
        runs = [_bench(args, url, workload, seed)
                for seed in range(max(1, getattr(args, "validate_repeats", 1)))]
        return _median_run(runs), overheads
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}, None
    finally:
        for process in reversed(processes):
            stop(process)


def _bench(args, url: str, workload: Workload, seed: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        command = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", url,
                   "--model", args.model, "--tokenizer", args.model, "--workload", "random",
                   "--num-prompts", str(args.num_prompts), "--max-concurrency",
                   str(args.max_concurrency), "--input-len", str(workload.input_len),
                   "--output-len", str(workload.output_len), "--output-json", str(out),
                   "--seed", str(seed), "--no-progress"]
        load = os.getloadavg()[0]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode or not out.exists():
            raise RuntimeError(f"bench failed: {done.stdout[-500:]} {done.stderr[-500:]}")
        summary = json.loads(out.read_text())["summary"]
    return {"ttft_ms": summary["ttft_s"]["p50"] * 1e3, "tpot_ms": summary["tpot_s"]["p50"] * 1e3,
            "throughput_tok_s": summary["output_throughput"], "load_average": load}


def _median_run(runs: list[dict]) -> dict:
    """Each figure's median over the bench runs of one deployment (the VM's neighbours move
    a single run by 20-50% from one minute to the next), and every run's own figures."""
    from statistics import median

    figures = {key: median(run[key] for run in runs) for key in runs[0]}
    return dict(figures, runs=runs) if len(runs) > 1 else figures


def validation_table(validation: dict) -> str:
    lines = [f"validation ({validation['num_prompts']} requests per deployment, concurrency "
             f"{validation['max_concurrency']}, median of {validation.get('repeats', 1)} "
             f"run(s); load average {validation['load_average'][0]:.2f})",
             "| deployment | TTFT ms pred / meas (err) | TPOT ms pred / meas (err) | "
             "tok/s pred / meas (err) |", "|---|---|---|---|"]
    for row in validation["deployments"]:
        if "error" in row:
            lines.append(f"| {row['name']} | failed: {row['error'][:80]} | | |")
            continue
        cells = [f"{row[k]['predicted']:.1f} / {row[k]['measured']:.1f} "
                 f"({row[k]['error']:+.0%})" for k in ("ttft_ms", "tpot_ms",
                                                        "throughput_tok_s")]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    lines.append(f"{validation['within_20_percent']} deployments within 20% on all three")
    return "\n".join(lines)
