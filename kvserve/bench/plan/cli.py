"""`kvserve plan` argument parsing and driver."""

from __future__ import annotations

import json
import sys

from kvserve.bench.plan.hardware import PROFILES


def add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="pick a deployment (TP/PP/replicas, P/D, weight and KV formats) for a "
        "model, hardware and SLOs, from the roofline; --validate measures it here")
    plan.add_argument("--model", required=True,
                      help="what `kvserve serve --model` loads, an HF config.json path, or a "
                      "built-in shape: llama-3-8b, llama-3-70b, deepseek-v3")
    plan.add_argument("--hardware", default="this",
                      help=f"this (measured now) or one of {', '.join(PROFILES)}")
    plan.add_argument("--devices", type=int, default=None,
                      help="devices to deploy on (default: one node's: 8 GPUs, 1 CPU)")
    plan.add_argument("--input-len", type=int, default=256)
    plan.add_argument("--output-len", type=int, default=128)
    plan.add_argument("--prefix-share", type=float, default=0.0,
                      help="fraction of each prompt already in the prefix cache")
    plan.add_argument("--arrival", choices=["steady", "burst", "closed"], default="steady",
                      help="steady: spread arrivals; burst: one wave of requests at once; "
                      "closed: a closed loop of fixed-length requests, as `kvserve bench "
                      "serve --max-concurrency` runs (simulated step by step)")
    plan.add_argument("--ttft-ms", type=float, default=None)
    plan.add_argument("--tpot-ms", type=float, default=None)
    plan.add_argument("--quantization", action="append", default=None,
                      help="weight formats to consider (repeatable; default: the hardware's)")
    plan.add_argument("--kv-cache-dtype", action="append", default=None,
                      help="KV dtypes to consider (repeatable; default: the hardware's)")
    plan.add_argument("--max-num-seqs", type=int, default=256,
                      help="sequences one engine instance batches at most (the engine's flag)")
    plan.add_argument("--recalibrate", action="store_true",
                      help="--hardware this: measure the engine's overheads again")
    plan.add_argument("--validate", action="store_true",
                      help="serve and `kvserve bench serve` the candidates this machine runs, "
                      "and report the prediction errors (minutes)")
    plan.add_argument("--num-prompts", type=int, default=32,
                      help="--validate: requests per candidate (8 waves at concurrency 4: "
                      "the last wave's tail is then a small part of the run)")
    plan.add_argument("--max-concurrency", type=int, default=4,
                      help="--validate: concurrency each candidate is measured at")
    plan.add_argument("--validate-repeats", type=int, default=1,
                      help="--validate: bench runs per deployment, the median of each figure "
                      "reported (a shared VM moves one run by 20-50%%)")
    plan.add_argument("--validate-calibration", choices=["each", "cache"], default="each",
                      help="--validate: each: calibrate a single engine's overheads on its own "
                      "server just before its bench (this VM drifts 20%% and more between "
                      "minutes and processes); cache: this machine's cached calibration")
    plan.add_argument("--validate-only", default=None, metavar="NAME",
                      help="--validate only the deployments whose name contains NAME "
                      "(weights, KV, replicas, 1P1D)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--output-json", default=None)


def run_plan(args) -> int:
    from kvserve.bench.plan import make_plan
    from kvserve.bench.plan.hardware import named_profile
    from kvserve.bench.plan.predict import SLO, Workload
    from kvserve.bench.plan.shapes import PlanInputError, load_plan_model

    if not 0.0 <= args.prefix_share < 1.0 or args.input_len < 1 or args.output_len < 1:
        raise PlanInputError("--input-len and --output-len must be >= 1, --prefix-share in "
                             "[0, 1)")
    config, runnable = load_plan_model(args.model)
    if args.hardware == "this":
        from kvserve.bench.plan.calibrate import this_machine

        if not runnable:
            raise PlanInputError("--hardware this calibrates the engine on the model itself: "
                                 "give a model kvserve loads, or a named hardware profile")
        hardware = this_machine(args.model, config, args.recalibrate)
    else:
        hardware = named_profile(args.hardware)
    devices = args.devices or hardware.devices_per_node
    workload = Workload(args.input_len, args.output_len, args.prefix_share, args.arrival)
    slo = SLO(args.ttft_ms, args.tpot_ms)
    plan = make_plan(args.model, config, hardware, devices, workload, slo,
                     tuple(args.quantization or ()), tuple(args.kv_cache_dtype or ()),
                     args.max_num_seqs)
    if args.validate:
        from kvserve.bench.plan.validate import validate

        if not runnable or hardware.kind != "cpu" or devices != 1:
            raise PlanInputError("--validate runs the candidates here: give a model kvserve "
                                 "loads and --hardware this")
        plan["validation"] = validate(args, config, hardware, workload)
    _print(plan, args)
    return 0


def _print(plan: dict, args) -> None:
    from kvserve.bench.plan.report import summary, table
    from kvserve.bench.plan.validate import validation_table

    text = json.dumps(plan, indent=1, default=str)
    if args.output_json:
        with open(args.output_json, "w") as handle:
            handle.write(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
        return
    print(summary(plan))
    print(table(plan))
    if "validation" in plan:
        print(validation_table(plan["validation"]))
