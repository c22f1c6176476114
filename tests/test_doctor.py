"""The bottleneck doctor: the rules on synthetic windows, the step ledger's counts, and the
regime named right on four staged cases against live servers (`kvserve doctor --url`, /doctor
and the kvserve:bottleneck_regime gauge): a single stream on float32 SmolLM2 is bandwidth-bound,
a batch of 32 prompts is compute-bound, the tiny model at batch 1 is overhead-bound, and a KV
pool too small for its requests is capacity-bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvserve.bottleneck import Sample, diagnose
from kvserve.testing.server import ServerProcess
from tests.helpers import read_metrics, tiny_server_flags

# roof 10 GB/s and 100 GFLOP/s; 10 steps of 1 s each unless a case says otherwise
ROOF = {"memory_gbps": 10.0, "gemm_gflops": 100.0, "max_num_seqs": 8}


def window(**last) -> list[Sample]:
    first = Sample(0.0, **ROOF)
    end = {"steps": 10, "seconds": 10.0, "tokens": 10, **ROOF, **last}
    return [first, Sample(10.0, **end)]


def test_idle_without_steps():
    assert diagnose([Sample(0.0, **ROOF), Sample(5.0, **ROOF)]).regime == "idle"


@pytest.mark.parametrize("case, regime", [
    ({"bytes": 80e9, "flops": 100e9}, "bandwidth"),  # bytes need 8 s of 10, FLOPs 1 s
    ({"bytes": 10e9, "flops": 900e9}, "compute"),  # FLOPs need 9 s
    ({"bytes": 20e9, "flops": 200e9}, "overhead"),  # bytes 2 s, FLOPs 2 s: 8 s of the rest
    ({"bytes": 80e9, "preemptions": 3}, "capacity"),
    ({"bytes": 80e9, "waiting": 4, "kv_usage": 0.95}, "capacity"),
    ({"bytes": 80e9, "waiting": 4, "running": 8, "kv_usage": 0.4}, "queueing"),
    ({"bytes": 80e9, "waiting": 4, "running": 3, "kv_usage": 0.4}, "bandwidth"),
])
def test_rules(case, regime):
    diagnosis = diagnose(window(**case))
    assert diagnosis.regime == regime, diagnosis
    assert diagnosis.summary and diagnosis.advice.count("--") >= 1


def test_numbers_and_kv_advice():
    diagnosis = diagnose(window(bytes=80e9, kv_bytes=60e9, flops=100e9, prefill_tokens=5))
    numbers = diagnosis.numbers
    assert numbers["bandwidth_share"] == 0.8 and numbers["compute_share"] == 0.1
    assert numbers["overhead_share"] == pytest.approx(0.2)
    assert numbers["achieved_gbps"] == 8.0 and numbers["kv_share_of_bytes"] == 0.75
    assert numbers["prefill_share"] == 0.5 and numbers["step_ms"] == 1000.0
    assert "--kv-cache-dtype int8" in diagnosis.advice


def test_no_roof_reads_unknown():
    diagnosis = diagnose(window(memory_gbps=0.0, gemm_gflops=0.0, bytes=1e9))
    assert diagnosis.regime == "unknown" and "--no-step-ledger" in diagnosis.summary


def test_step_ledger_counts_a_step(tiny_llm):
    """A prompt of 10 tokens then one decode step: the counts follow the model's shape."""
    from kvserve import SamplingParams

    core = tiny_llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    ledger = core.step_ledger
    before = (ledger.totals.steps, ledger.totals.tokens, ledger.totals.flops,
              ledger.totals.bytes, ledger.totals.prefill_tokens)
    tiny_llm.generate({"prompt_token_ids": list(range(1, 11))},
                      SamplingParams(max_tokens=2, temperature=0))
    totals, cost = ledger.totals, ledger.cost
    steps, tokens = totals.steps - before[0], totals.tokens - before[1]
    assert (steps, tokens, totals.prefill_tokens - before[4]) == (2, 11, 10)
    pairs = 10 * 11 // 2 + 11  # the prompt's causal pairs, then the decode's 11 positions
    flops = (11 * cost.layer_flops_per_token + 2 * cost.lm_head_flops_per_token
             + pairs * ledger.attention_flops_per_pair)
    assert totals.flops - before[2] == pytest.approx(flops)
    kv = ledger.kv_bytes_per_token * ((10 + 10) + (11 + 1))  # context read + new K/V written
    assert totals.bytes - before[3] == pytest.approx(2 * cost.weight_bytes + kv)
    stats = core.stats()
    assert stats.step_count == totals.steps and stats.roof_memory_gbps > 0


def test_no_step_ledger_switch(tiny_model_dir):
    from kvserve import LLM

    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
              engine_core="thread", step_ledger=False)
    core = llm.llm_engine.engine_core
    assert getattr(core, "engine_core", core).step_ledger is None


# ---- the four staged cases against live servers ----------------------------------------------
def run_doctor(url: str, window_s: float) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "doctor", "--url", url, "--window", str(window_s),
         "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def complete(url: str, prompt, max_tokens: int, **extra) -> None:
    response = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text


def while_loaded(load, read):
    """`read()` while `load()` runs again and again in a thread (so the window sees steps
    however slow the doctor's start is); the load finishes its round after."""
    done = threading.Event()

    def loop():
        while not done.is_set():
            load()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        return read()
    finally:
        done.set()
        thread.join(timeout=300)


def regime_gauge(url: str) -> str:
    values = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    on = [line for line in values
          if line.startswith("kvserve:bottleneck_regime{") and line.endswith(" 1.0")]
    assert len(on) == 1, on
    return on[0].split('regime="')[1].split('"')[0]


def fresh_roof(log) -> dict:
    """The server measures its roof now, under the load the test runs in, not a cached one."""
    return {"KVSERVE_ROOF_FILE": str(log.with_suffix(".roofs.json"))}


@pytest.fixture(scope="module")
def smol_fp32(tmp_path_factory):
    """SmolLM2 in float32 with unquantized weights: ~540 MB read per decode step. One thread:
    its roof is measured on one too, and a step never waits on a thread another process holds
    (this machine has two cores, and the suite runs beside other work)."""
    log = tmp_path_factory.mktemp("doctor") / "smol.log"
    flags = ["--dtype", "float32", "--quantization", "none", "--max-model-len", "512",
             "--num-threads", "1",
             "--num-kv-blocks", "256", "--served-model-name", "m", "--disable-log-requests"]
    with ServerProcess(flags, log_path=log, env=fresh_roof(log)) as server:
        yield server.base_url


@pytest.mark.slow
def test_single_stream_is_bandwidth_bound(smol_fp32):
    diagnosis = while_loaded(lambda: complete(smol_fp32, "The history of", 32),
                             lambda: run_doctor(smol_fp32, 2.0))
    assert diagnosis["regime"] == "bandwidth", diagnosis
    assert diagnosis["numbers"]["tokens_per_step"] < 1.5


@pytest.mark.slow
def test_batch_of_32_prompts_is_compute_bound(smol_fp32):
    """32 prompts of 48 tokens at once, one output each: the prefill's GEMMs bound the steps
    (read from the server's own /doctor, right after). They are sent while a 400-token prompt
    runs, so they reach the engine together and share steps, as a burst of users' would."""
    first = threading.Thread(target=complete, args=(smol_fp32, [[7] * 400], 1))
    first.start()
    time.sleep(0.3)
    complete(smol_fp32, [[100 + i + j for j in range(48)] for i in range(32)], 1)
    first.join()
    diagnosis = httpx.get(smol_fp32 + "/doctor", timeout=10).json()
    assert diagnosis["regime"] == "compute", diagnosis
    assert diagnosis["numbers"]["prefill_share"] > 0.9
    assert regime_gauge(smol_fp32) == "compute"


@pytest.fixture(scope="module")
def tiny_small_pool(tokenizer, tmp_path_factory):
    """The tiny random model with a 1,024-token vocabulary (its LM head 256 KB: with SmolLM2's
    49,152 the head's 12.6 MB read is most of a step, and a quiet machine reads it as
    bandwidth) and 12 KV blocks of 16 tokens (192 tokens in all)."""
    from kvserve.testing.tiny import write_tiny_model_dir

    directory = tmp_path_factory.mktemp("doctor-tiny")
    write_tiny_model_dir(directory / "model", tokenizer, vocab_size=1024)
    flags = tiny_server_flags(directory / "model", "--served-model-name", "m",
                              "--block-size", "16", kv_blocks=12, max_model_len=192)
    log = directory / "tiny.log"
    with ServerProcess(flags, log_path=log, env=fresh_roof(log)) as server:
        yield server.base_url


@pytest.mark.slow
def test_tiny_model_at_batch_1_is_overhead_bound(tiny_small_pool):
    diagnosis = while_loaded(lambda: complete(tiny_small_pool, [5, 6, 7], 100),
                             lambda: run_doctor(tiny_small_pool, 1.0))
    assert diagnosis["regime"] == "overhead", diagnosis
    assert diagnosis["numbers"]["overhead_share"] > 0.5


@pytest.mark.slow
def test_a_pool_too_small_is_capacity_bound(tiny_small_pool):
    """6 requests that each grow to 160 tokens in a 192-token pool: preempted in turns."""
    before = read_metrics(tiny_small_pool)["kvserve:num_preemptions_total"]

    def load():
        threads = [threading.Thread(target=complete, args=(tiny_small_pool, [9, 8, 7], 157))
                   for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    diagnosis = while_loaded(load, lambda: run_doctor(tiny_small_pool, 2.0))
    assert read_metrics(tiny_small_pool)["kvserve:num_preemptions_total"] > before
    assert diagnosis["regime"] == "capacity", diagnosis
    assert "--kv-cache-dtype int8" in diagnosis["advice"]


def test_doctor_cli_says_what_is_wrong_with_a_bad_url():
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "doctor", "--url",
                             "http://127.0.0.1:9", "--window", "0.1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "cannot read http://127.0.0.1:9/metrics" in result.stderr


def test_roof_is_measured_once_and_kept(tmp_path, monkeypatch, tiny_model_dir):
    """The first engine on a machine measures; the next reads the file (a measure now would
    raise); a file measured under a load twice today's is measured again."""
    from kvserve import roofline
    from kvserve.config import ModelConfig

    config = ModelConfig.from_hf_dict(json.loads((tiny_model_dir / "config.json").read_text()))
    monkeypatch.setenv("KVSERVE_ROOF_FILE", str(tmp_path / "roofs.json"))
    first = roofline.cached_roof(config)
    assert first.memory_gbps > 0 and first.gemm_gflops["float32"] > 0

    def no_measure(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(roofline, "measure_memory_bandwidth", no_measure)
    assert roofline.cached_roof(config) == first
    known = json.loads((tmp_path / "roofs.json").read_text())
    for entry in known.values():
        entry["load"] = 4 * os.getloadavg()[0] + 1.0
    (tmp_path / "roofs.json").write_text(json.dumps(known))
    with pytest.raises(AssertionError, match="measured again"):
        roofline.cached_roof(config)


def test_a_fresh_server_reads_idle_over_the_whole_window():
    from kvserve.metrics import DOCTOR_WINDOW_S, EngineMetrics

    diagnosis = EngineMetrics("m").diagnosis()
    assert diagnosis.regime == "idle"
    assert diagnosis.summary == f"no engine step in the last {DOCTOR_WINDOW_S:.1f} s"
