"""Benchmark statistics and workload generators: exact maths, determinism, lengths as asked."""

from __future__ import annotations

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


def test_decode_roof_is_min_of_memory_and_compute():
    cost = roofline.ModelCost(layer_flops_per_token=200e6, lm_head_flops_per_token=0,
                              weight_bytes=200e6, kv_bytes_per_token=0)
    roof = roofline.MachineRoof(memory_gbps=40.0, gemm_gflops={"bfloat16": 400.0}, threads=2)
    assert roofline.decode_roof_tokens_per_s(cost, roof, 1, 0) == pytest.approx(200.0)
    assert roofline.decode_roof_tokens_per_s(cost, roof, 1000, 0) == pytest.approx(2000.0)
