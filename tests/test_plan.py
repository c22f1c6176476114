"""`kvserve plan`: the cost model on known shapes, the recommendation's response to SLOs and
hardware, the JSON schema, and (soak) one --validate run. No benchmark runs in make test."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from dataclasses import replace

import pytest

from kvserve.bench import roofline
from kvserve.bench.plan import make_plan
from kvserve.bench.plan.cost import attention_flops_per_token, plan_cost
from kvserve.bench.plan.hardware import CPU_2CORE, H100_SXM, H200, named_profile
from kvserve.bench.plan.predict import SLO, Candidate, Workload
from kvserve.bench.plan.search import predict
from kvserve.bench.plan.shapes import load_plan_model
from kvserve.cli import main

BF16 = roofline.weight_format("bfloat16", "none")
CHAT = Workload(input_len=2048, output_len=256)


def _plan_json(*argv: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def test_gqa_shapes_bytes_and_flops_per_token():
    """Llama 3: 8.03B / 70.55B parameters, 8 KV heads of 128 dims: 128 KiB / 320 KiB of bf16
    KV per token; a decode token does 2 FLOPs per weight it reads."""
    for name, params, kv in (("llama-3-8b", 8.03e9, 131072), ("llama-3-70b", 70.55e9, 327680)):
        config, runnable = load_plan_model(name)
        cost = plan_cost(config, BF16, "bfloat16")
        assert not runnable
        assert cost.resident_weight_bytes == pytest.approx(2 * params, rel=1e-3)
        assert cost.cost.kv_bytes_per_token == kv
        assert cost.kv_bytes_per_sequence(1000) == 1000 * kv
        flops = cost.cost.layer_flops_per_token + cost.cost.lm_head_flops_per_token
        embedding = config.hidden_size * config.vocab_size  # looked up, not multiplied
        assert flops == 2 * (cost.resident_weight_bytes / 2 - embedding)
        # a dense GQA model costs what the roofline says
        assert cost.cost == roofline.model_cost(config)
    # int8 KV: one byte plus a float32 scale per row of 128 values
    int8 = plan_cost(load_plan_model("llama-3-8b")[0], BF16, "int8")
    assert int8.cost.kv_bytes_per_token == 32 * 16 * (128 + 4)


def test_mla_and_moe_shape_of_deepseek_v3():
    """DeepSeek-V3: 671B parameters held, ~37B read per token; MLA caches one 512-latent plus
    64-dim RoPE key row per layer: 61 x 576 x 2 bytes = 70,272 bytes per token in bf16."""
    config, _ = load_plan_model("deepseek-v3")
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts,
            config.num_experts_per_tok, config.moe_intermediate_size, config.kv_lora_rank,
            config.head_dim, config.shared_expert_intermediate_size) == \
        (61, 7168, 256, 8, 2048, 512, 64, 2048)
    assert config.source_weight_type == "fp8"
    cost = plan_cost(config, BF16, "bfloat16")
    assert cost.cost.kv_bytes_per_token == 61 * 576 * 2
    assert cost.resident_weight_bytes / 2 == pytest.approx(671e9, rel=0.005)
    assert cost.cost.weight_bytes / 2 == pytest.approx(37e9, rel=0.02)
    assert cost.moe_layers == 58  # the first three layers are dense
    # absorbed MLA attention: 128 heads x (2 x 512 + 64) dims x 2 FLOPs per context token
    assert attention_flops_per_token(config, 100) == 61 * 2 * 128 * (2 * 512 + 64) * 100


def test_sliding_windows_cap_the_kv_of_their_layers():
    config, _ = load_plan_model("gemma3-270m")
    cost = plan_cost(config, BF16, "bfloat16")
    windows = [w for w in cost.windows if w]
    assert windows and len(windows) < len(cost.windows)
    per_layer = cost.kv_bytes_per_token_layer[0]
    full_layers = len(cost.windows) - len(windows)
    assert cost.kv_bytes_per_sequence(4096) == pytest.approx(
        per_layer * (full_layers * 4096 + sum(min(4096, w) for w in windows)))


def test_70b_on_one_2_core_cpu_does_not_fit():
    plan = _plan_json("--model", "llama-3-70b", "--hardware", "cpu-2core")
    assert plan["recommendation"] is None
    assert plan["candidates"] and not any(row["fits"] for row in plan["candidates"])
    assert all(row["limited_by"].startswith("memory") for row in plan["candidates"])


def test_json_schema():
    plan = _plan_json("--model", "llama-3-8b", "--hardware", "h100", "--devices", "2",
                      "--input-len", "1024", "--output-len", "128", "--ttft-ms", "1000",
                      "--tpot-ms", "40", "--prefix-share", "0.5")
    assert set(plan) >= {"model", "shape", "hardware", "devices", "workload", "slo",
                         "candidates", "recommendation"}
    assert plan["shape"]["kv_heads"] == 8 and plan["workload"]["prefix_share"] == 0.5
    assert plan["hardware"]["sources"]["spec"].startswith("https://www.nvidia.com/")
    layouts = {row["candidate"]["label"] for row in plan["candidates"]}
    assert layouts == {"TP1 PP2", "2 x TP1", "1P1D x TP1", "TP2"}
    best = plan["recommendation"]
    for key in ("candidate", "kv_capacity_tokens", "concurrency", "ttft_ms", "tpot_ms",
                "throughput_tok_s", "throughput_per_device_tok_s", "bound", "reason"):
        assert key in best
    assert best["ttft_ms"] <= 1000 and best["tpot_ms"] <= 40
    assert "kvserve serve --model llama-3-8b" in best["command"]
    assert f"--kv-cache-dtype {best['candidate']['kv_dtype']}" in best["command"]
    assert best["throughput_per_device_tok_s"] == pytest.approx(best["throughput_tok_s"] / 2)


def test_a_tighter_tpot_slo_lowers_the_concurrency_and_throughput():
    config, _ = load_plan_model("llama-3-8b")
    loose = make_plan("llama-3-8b", config, H100_SXM, 1, CHAT, SLO(tpot_ms=100))
    tight = make_plan("llama-3-8b", config, H100_SXM, 1, CHAT, SLO(tpot_ms=15))
    assert loose["recommendation"]["limited_by"] != "TPOT SLO" or \
        loose["recommendation"]["tpot_ms"] <= 100
    assert tight["recommendation"]["tpot_ms"] <= 15
    assert tight["recommendation"]["concurrency"] < loose["recommendation"]["concurrency"]
    assert tight["recommendation"]["throughput_tok_s"] < \
        loose["recommendation"]["throughput_tok_s"]
    impossible = make_plan("llama-3-8b", config, H100_SXM, 1, CHAT, SLO(tpot_ms=1))
    assert impossible["recommendation"] is None


def test_hardware_decides_what_fits_and_how_fast():
    """bf16 70B (141 GB) fits neither one H100 nor two (70.5 GB a device beside 80 x 0.9 - 4
    usable), but two H200 with room for KV; H200's bandwidth makes the same deployment's TPOT
    shorter and its memory the KV capacity larger."""
    config, _ = load_plan_model("llama-3-70b")
    one = (("none",), ("bfloat16",))
    assert make_plan("x", config, H100_SXM, 1, CHAT, SLO(), *one)["recommendation"] is None
    two_h100 = make_plan("x", config, H100_SXM, 2, CHAT, SLO(), *one)
    two_h200 = make_plan("x", config, H200, 2, CHAT, SLO(), *one)
    assert two_h100["recommendation"] is None  # 70.5 GB a device beside 68 usable
    best = two_h200["recommendation"]
    assert best is not None and best["candidate"]["tp"] * best["candidate"]["pp"] == 2
    # the same candidate at the same batch: H200's 4.8 TB/s against H100's 3.35
    cand = Candidate(8, 1, 1, "aggregated", "fp8", "fp8")
    h100 = predict(config, H100_SXM, cand, CHAT, SLO(), batch=32).latency
    h200 = predict(config, H200, cand, CHAT, SLO(), batch=32).latency
    assert h200.tpot_s < h100.tpot_s
    assert predict(config, H200, cand, CHAT, SLO()).kv_capacity_tokens > \
        predict(config, H100_SXM, cand, CHAT, SLO()).kv_capacity_tokens


def test_int8_kv_doubles_what_a_memory_bound_cpu_holds():
    config, _ = load_plan_model("llama-3-8b")
    small = replace(CPU_2CORE, memory_bytes=24e9)
    work = Workload(input_len=1024, output_len=128)
    bf16 = predict(config, small, Candidate(1, 1, 1, "aggregated", "int4", "bfloat16"), work,
                   SLO())
    int8 = predict(config, small, Candidate(1, 1, 1, "aggregated", "int4", "int8"), work,
                   SLO())
    assert int8.kv_capacity_tokens / bf16.kv_capacity_tokens == pytest.approx(
        2 / (1 + 4 / 128), rel=0.01)


def test_calibration_recovers_known_overheads():
    """Measurements made of the roofline's time plus known overheads give those back."""
    from kvserve.bench.plan import calibrate
    from kvserve.bench.plan.cost import plan_cost as cost_of
    from kvserve.bench.plan.predict import InstanceModel, compute_dtype
    from kvserve.bench.plan.search import weight_format

    config, _ = load_plan_model("smollm2-135m-instruct")
    base = replace(CPU_2CORE, step_overhead_s=0.0, seq_overhead_s=0.0,
                   prefill_token_overhead_s=0.0)
    quant = calibrate.default_quantization(config)
    model = InstanceModel(config, cost_of(config, weight_format(config, base, quant),
                                          "bfloat16"), base,
                          Candidate(1, 1, 1, "aggregated", quant, "bfloat16"),
                          compute_dtype(base, quant))
    fixed, per_seq, per_prefill, per_token = 4e-3, 0.3e-3, 20e-3, 0.1e-3

    def roof(times):
        return max(times.memory_s, times.compute_s)

    def engine_prefill(tokens):  # one lone prompt's step in the engine core
        return roof(model.prefill(tokens, tokens)) + fixed + per_prefill + tokens * per_token

    one = roof(model.decode_step(1, 256 + 33 / 2)) + fixed + per_seq
    many = roof(model.decode_step(8, 64 + 33 / 2)) + fixed + 8 * per_seq
    fitted = calibrate.fit_overheads(config, base, {
        "prefill_s": {str(n): engine_prefill(n) for n in calibrate.PREFILL_LENGTHS},
        "request_s": 8e-3, "step_1_s": one, "step_8_s": many})
    assert fitted["step_overhead_s"] == pytest.approx(fixed)
    assert fitted["seq_overhead_s"] == pytest.approx(per_seq)
    assert fitted["prefill_step_overhead_s"] == pytest.approx(per_prefill)
    assert fitted["prefill_token_overhead_s"] == pytest.approx(per_token)
    assert fitted["request_overhead_s"] == 8e-3
    # and the model gives the lone prefills back
    fitted_model = InstanceModel(config, model.cost, replace(base, **fitted), model.cand,
                                 compute_dtype(base, quant))
    assert fitted_model.prefill(448, 448).total_s == pytest.approx(engine_prefill(448))


def test_prefill_line_is_least_squares_and_never_negative():
    from kvserve.bench.plan.calibrate import _line

    # noisy points about 0.02 + 0.001 x: the least-squares line, not the two ends'
    lengths = [64, 128, 256, 448]
    intercept, slope = _line(lengths, [0.084, 0.150, 0.270, 0.470])
    assert slope == pytest.approx(0.001, rel=0.05)
    assert intercept == pytest.approx(0.02, abs=0.005)
    # falling points (noise) never give a negative slope, nor a negative intercept
    assert _line(lengths, [0.3, 0.2, 0.2, 0.1]) == (pytest.approx(0.2), 0.0)
    intercept, slope = _line(lengths, [0.0, 0.05, 0.25, 0.45])
    assert intercept == 0.0 and slope > 0


def test_only_single_engines_are_calibrated_before_their_bench():
    """--validate-calibration each: a single engine's own server is calibrated; replicas and
    P/D (the calibration's lone prompts would measure one of their engines) use the cache."""
    import argparse

    from kvserve.bench.plan.validate import calibrates_here, deployments

    config, _ = load_plan_model("smollm2-135m-instruct")
    each, cache = (argparse.Namespace(validate_calibration=c) for c in ("each", "cache"))
    chosen = {d.name: calibrates_here(each, d) for d in deployments(config)}
    assert chosen == {"weights gguf": True, "weights none": True, "weights int4": True,
                      "KV int8": True, "2 replicas (Ray Serve)": False,
                      "1P1D (router)": False}
    assert not any(calibrates_here(cache, d) for d in deployments(config))


def test_request_overhead_is_paid_once_by_a_lone_request():
    """The API server's per-request path adds to a lone (steady) request's TTFT and not to
    its decode steps; the closed loop leaves it out (it schedules a request a step late)."""
    config, _ = load_plan_model("smollm2-135m-instruct")
    cand = Candidate(1, 1, 1, "aggregated", "none", "bfloat16")
    work = Workload(256, 64)
    without = predict(config, CPU_2CORE, cand, work, SLO(), batch=1).latency
    paying = predict(config, replace(CPU_2CORE, request_overhead_s=0.05), cand, work, SLO(),
                     batch=1).latency
    assert paying.ttft_s == pytest.approx(without.ttft_s + 0.05)
    assert paying.tpot_s == pytest.approx(without.tpot_s)
    closed = replace(work, arrival="closed", requests=8)
    assert predict(config, replace(CPU_2CORE, request_overhead_s=0.05), cand, closed, SLO(),
                   batch=2).latency == predict(config, CPU_2CORE, cand, closed, SLO(),
                                               batch=2).latency


def test_bad_input_is_a_clear_error(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--hardware", "tpu-v9"]) == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3-8b", "--hardware", "this"]) == 2
    assert "named hardware profile" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3-8b", "--hardware", "h100",
                 "--prefix-share", "1.5"]) == 2
    assert named_profile("H100").name == "h100-sxm"


@pytest.mark.soak
def test_validate_the_smallest_candidate(tmp_path):
    """One deployment served and benchmarked; its prediction error is reported (not
    asserted small: the machine's load moves it)."""
    import argparse

    from kvserve.bench.plan.validate import validate

    config, _ = load_plan_model("smollm2-135m-instruct")
    args = argparse.Namespace(model="smollm2-135m-instruct", num_prompts=8, max_concurrency=2)
    result = validate(args, config, CPU_2CORE, Workload(128, 32), only=1)
    row = result["deployments"][0]
    assert "error" not in row, row
    for key in ("ttft_ms", "tpot_ms", "throughput_tok_s"):
        assert row[key]["measured"] > 0 and row[key]["predicted"] > 0
        assert row[key]["error"] == pytest.approx(
            (row[key]["predicted"] - row[key]["measured"]) / row[key]["measured"])


def test_dp_attention_stops_mla_kv_replication():
    """Under TP each rank keeps DeepSeek's whole latent KV; DP attention keeps each rank's own
    sequences: 8x the tokens per free byte on 8 ranks, less room for the attention (and dense)
    weights it replicates."""
    config, _ = load_plan_model("deepseek-v3")
    tp8 = Candidate(8, 1, 1, "aggregated", "fp8", "fp8")
    plain = predict(config, H200, tp8, CHAT, SLO())
    dp = predict(config, H200, replace(tp8, dp_attention=True), CHAT, SLO())
    assert dp.weight_bytes_per_device > plain.weight_bytes_per_device
    free = H200.memory_bytes * H200.memory_fraction - H200.engine_overhead_bytes
    assert dp.kv_capacity_tokens / plain.kv_capacity_tokens == pytest.approx(
        8 * (free - dp.weight_bytes_per_device) / (free - plain.weight_bytes_per_device),
        rel=1e-4)
    assert dp.candidate.label() == "DP8-attn EP8"


def test_closed_loop_of_one_client_is_prefill_then_steps():
    """One client, a prompt inside the budget: TTFT is its prefill step, then a decode step
    a token; its next request finds the engine idle."""
    from kvserve.bench.plan.simulate import LoopShape, closed_loop

    def step_s(decodes: int, prompt_tokens: int, context: float) -> float:
        return 0.010 * decodes + 0.001 * prompt_tokens

    loop = closed_loop(step_s, LoopShape(clients=1, requests=5, prompt_len=100,
                                         output_len=11, token_budget=512))
    assert loop.ttft_s == pytest.approx(0.100)
    assert loop.tpot_s == pytest.approx(0.010)
    assert loop.throughput == pytest.approx(5 * 11 / (5 * (0.100 + 10 * 0.010)))
    assert loop.steps == 5 * 11


def test_closed_loop_first_arrival_alone_then_the_others_together():
    """Four requests sent at once: the idle engine prefills the first alone; the other three
    arrive during that step and share the next one (3 x 128 tokens fit the 512 budget) with
    the first's decode, which stalls behind them. A 128-token budget queues them instead."""
    from kvserve.bench.plan.simulate import LoopShape, closed_loop

    def step_s(decodes: int, prompt_tokens: int, context: float) -> float:
        return 0.001 + 0.002 * decodes + 0.0005 * prompt_tokens

    shape = LoopShape(clients=4, requests=4, prompt_len=128, output_len=8, token_budget=512)
    wave = closed_loop(step_s, shape)
    alone, together = 0.001 + 0.0005 * 128, 0.001 + 0.002 + 0.0005 * 384
    full, three = 0.001 + 0.002 * 4, 0.001 + 0.002 * 3
    assert wave.ttft_s == pytest.approx(alone + together)  # the three's, the median
    assert wave.tpot_s == pytest.approx((6 * full + three) / 7)  # theirs, not the first's
    assert wave.steps == 9
    queued = closed_loop(step_s, replace(shape, token_budget=128))
    assert queued.ttft_s > alone + 0.001 + 0.0005 * 127  # behind at least one more prompt
    assert queued.steps > wave.steps


def test_disaggregated_loop_prefills_on_one_server_and_decodes_on_the_other():
    """One client: prefill, the handoff, then its first token from the decode server's first
    step, and a step a token after. Prompts waiting for the prefill server share its next
    step (2 x 128 within the budget) and are decoded together; a prompt longer than the
    budget is prefilled alone, chunk by chunk."""
    from kvserve.bench.plan.simulate import LoopShape, SplitCosts, disaggregated_loop

    costs = SplitCosts(prefill=lambda tokens: 0.01 + 0.001 * tokens,
                       decode=lambda seqs, context: 0.005 + 0.001 * seqs, transfer_s=0.02)
    one = disaggregated_loop(costs, LoopShape(clients=1, requests=3, prompt_len=128,
                                              output_len=5, token_budget=512))
    assert one.ttft_s == pytest.approx(0.01 + 0.128 + 0.02 + 0.006)
    assert one.tpot_s == pytest.approx(0.006)
    assert one.throughput == pytest.approx(15 / (3 * (0.158 + 5 * 0.006)))
    # three sent together: the idle prefill server takes the first alone (as an idle engine
    # does), the other two arrive during it and share the next prefill step, then a decode step
    three = disaggregated_loop(costs, LoopShape(clients=3, requests=3, prompt_len=128,
                                                output_len=5, token_budget=512))
    second = 0.138 + 0.01 + 0.256 + 0.02 + 0.007  # after the first's 0.138 s prefill
    assert three.ttft_s == pytest.approx(second)  # the median: the later two's
    assert three.tpot_s == pytest.approx(0.007)
    long = disaggregated_loop(costs, LoopShape(clients=1, requests=1, prompt_len=1000,
                                               output_len=2, token_budget=512))
    assert long.ttft_s == pytest.approx(0.01 + 0.512 + 0.01 + 0.488 + 0.02 + 0.006)


def test_pd_handoff_is_what_a_lone_prompt_pays_beyond_the_model():
    from kvserve.bench.plan.validate import deployments, handoff_overheads

    config, _ = load_plan_model("smollm2-135m-instruct")
    pair = next(d.candidate for d in deployments(config) if d.candidate.mode == "disaggregated")
    lone = replace(Workload(256, 2), arrival="steady")
    modelled = predict(config, CPU_2CORE, pair, lone, SLO(), batch=1).latency.ttft_s
    fitted = handoff_overheads(config, CPU_2CORE, pair, modelled + 0.05, 256)
    assert fitted["kv_handoff_overhead_s"] == pytest.approx(0.05, abs=0.005)
    assert fitted["step_overhead_s"] == CPU_2CORE.step_overhead_s
    faster = handoff_overheads(config, CPU_2CORE, pair, 0.001, 256)
    assert faster["kv_handoff_overhead_s"] == 0.0  # never negative
    # and the closed loop charges it to every request's TTFT
    loop = replace(Workload(256, 16), arrival="closed", requests=4)
    charged = replace(CPU_2CORE, kv_handoff_overhead_s=0.05)
    assert predict(config, charged, pair, loop, SLO(), batch=1).latency.ttft_s == \
        pytest.approx(predict(config, CPU_2CORE, pair, loop, SLO(), batch=1).latency.ttft_s
                      + 0.05)


def test_per_format_overheads_are_looked_up_by_weights_and_kv():
    from kvserve.bench.plan.hardware import OVERHEAD_FIELDS, Overheads

    table = {"int4/bfloat16": dict(zip(OVERHEAD_FIELDS, (1.0, 2.0, 2.5, 3.0))),
             "int4/int8": dict(zip(OVERHEAD_FIELDS, (4.0, 5.0, 5.5, 6.0)))}
    hardware = replace(CPU_2CORE, format_overheads=table)
    assert hardware.overheads("int4", "int8") == Overheads(4.0, 5.0, 5.5, 6.0)
    assert hardware.overheads("int4", "bfloat16") == Overheads(1.0, 2.0, 2.5, 3.0)
    assert hardware.overheads("int4", "fp8") == Overheads(1.0, 2.0, 2.5, 3.0)  # the weights'
    assert hardware.overheads("none", "bfloat16") == Overheads(
        CPU_2CORE.step_overhead_s, CPU_2CORE.seq_overhead_s, CPU_2CORE.prefill_step_overhead_s,
        CPU_2CORE.prefill_token_overhead_s)


def test_closed_loop_search_bisects_to_the_scan():
    """Under a closed loop the search bisects over the batch; a step-by-step scan of the
    same predictions finds the same largest batch."""
    config, _ = load_plan_model("smollm2-135m-instruct")
    work = Workload(256, 32, arrival="closed", requests=16)
    cand = Candidate(1, 1, 1, "aggregated", "none", "bfloat16")
    slo = SLO(tpot_ms=40.0)
    found = predict(config, CPU_2CORE, cand, work, slo, max_num_seqs=24)
    scanned = [b for b in range(1, 25) if predict(config, CPU_2CORE, cand, work, slo,
                                                   batch=b).latency.tpot_s * 1e3 <= 40.0]
    assert found.batch == max(scanned) and found.batch < 24
    assert found.limited_by == "TPOT SLO"


def test_disaggregated_closed_loop_runs_at_most_max_num_seqs():
    """`kvserve plan --max-num-seqs` caps a P/D pair's decode server as it caps one engine: 8
    clients on a server that runs 2 at a time wait for each other's decodes."""
    config, _ = load_plan_model("smollm2-135m-instruct")
    work = Workload(256, 32, arrival="closed", requests=16)
    pair = Candidate(1, 1, 2, "disaggregated", "none", "bfloat16", prefill_instances=1,
                     share=0.5)
    slo = SLO()
    roomy = predict(config, CPU_2CORE, pair, work, slo, batch=8).latency
    capped = predict(config, CPU_2CORE, pair, work, slo, batch=8, max_num_seqs=2).latency
    assert capped.ttft_s > 1.5 * roomy.ttft_s
    assert capped.throughput < roomy.throughput


def test_validate_repeats_report_each_figures_median():
    from kvserve.bench.plan.validate import _median_run

    runs = [{"ttft_ms": t, "tpot_ms": p, "throughput_tok_s": r, "load_average": 1.0}
            for t, p, r in ((300.0, 15.0, 200.0), (250.0, 18.0, 150.0), (500.0, 14.0, 180.0))]
    merged = _median_run(runs)
    assert (merged["ttft_ms"], merged["tpot_ms"], merged["throughput_tok_s"]) == (
        300.0, 15.0, 180.0)
    assert merged["runs"] == runs
    assert "runs" not in _median_run(runs[:1])


def test_a_lone_prefill_is_timed_in_the_engine_core(smol_server):
    """The calibration's prefills read the server's step ledger: one step, timed in the
    engine core, shorter than the client's TTFT (which adds the API server's path)."""
    import asyncio

    from kvserve.bench.client import BenchClient
    from kvserve.bench.plan.calibrate import _lone_prefill

    async def one() -> tuple[float, float]:
        client = BenchClient(smol_server.base_url, "smol")
        try:
            return await _lone_prefill(client, "The history of the printing press " * 12)
        finally:
            await client.close()

    engine_s, ttft_s = asyncio.run(one())
    assert 0.0 < engine_s < ttft_s < 30.0
