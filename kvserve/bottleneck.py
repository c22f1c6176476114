"""The bottleneck doctor: what bounds a server over a window of its steps, in words and numbers,
and which flag would move it (the seven-layer chapter's taxonomy: compute, bandwidth, overhead,
capacity, scheduling).

Read from counters any /metrics scrape has (the step ledger's totals, kvserve.core.step_ledger,
and the scheduler's gauges), so the server's own gauge, `/doctor` and `kvserve doctor --url`
diagnose alike. The order of the rules:

1. no step in the window: idle;
2. preemptions, or requests waiting while the KV pool is (nearly) full: capacity;
3. requests waiting while the batch is at --max-num-seqs: queueing (the scheduler's cap binds);
4. else the steps' time split three ways against this machine's roof: what their bytes need at
   the measured bandwidth, what their FLOPs need at the measured GEMM rate, and the rest
   (per-step fixed costs: Python, scheduling, thread hand-offs, kernels below the roof); the
   largest share names the regime: bandwidth, compute or overhead.

Standard library only: the CLI and the front-end use it without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

REGIMES = ("idle", "capacity", "queueing", "bandwidth", "compute", "overhead")
KV_FULL = 0.9  # usage at which waiting requests are taken to wait for blocks

# the Prometheus names (kvserve.metrics) each Sample field is read from
COUNTERS = {
    "steps": "kvserve:engine_steps_total",
    "seconds": "kvserve:engine_step_seconds_total",
    "tokens": "kvserve:engine_step_tokens_total",
    "prefill_tokens": "kvserve:engine_step_prefill_tokens_total",
    "flops": "kvserve:engine_step_flops_total",
    "bytes": "kvserve:engine_step_bytes_total",
    "kv_bytes": "kvserve:engine_step_kv_bytes_total",
    "preemptions": "kvserve:num_preemptions_total",
}
GAUGES = {
    "running": "kvserve:num_requests_running",
    "waiting": "kvserve:num_requests_waiting",
    "kv_usage": "kvserve:kv_cache_usage_perc",
    "memory_gbps": "kvserve:roofline_memory_gbps",
    "gemm_gflops": "kvserve:roofline_gemm_gflops",
    "max_num_seqs": "kvserve:scheduler_max_num_seqs",
}


@dataclass
class Sample:
    """One read of the counters and gauges, at `time` (seconds, any monotonic clock)."""
    time: float
    steps: float = 0.0
    seconds: float = 0.0
    tokens: float = 0.0
    prefill_tokens: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    kv_bytes: float = 0.0
    preemptions: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    memory_gbps: float = 0.0
    gemm_gflops: float = 0.0
    max_num_seqs: float = 0.0

    @classmethod
    def from_metrics(cls, time: float, values: dict[str, float]) -> "Sample":
        """From {Prometheus sample name: value} (one model's series)."""
        names = {**COUNTERS, **GAUGES}
        return cls(time, **{key: values.get(name, 0.0) for key, name in names.items()})


@dataclass
class Diagnosis:
    regime: str
    summary: str  # what bounds it, with the numbers
    advice: str  # which flags would move it
    numbers: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def diagnose(samples: list[Sample]) -> Diagnosis:
    """The regime over the window the samples span (at least two)."""
    first, last = samples[0], samples[-1]
    steps = last.steps - first.steps
    window = max(last.time - first.time, 1e-9)
    waiting = sum(s.waiting for s in samples) / len(samples)
    running = sum(s.running for s in samples) / len(samples)
    kv_peak = max(s.kv_usage for s in samples)
    preempted = last.preemptions - first.preemptions
    numbers = {"window_s": round(window, 3), "steps": steps, "mean_running": round(running, 2),
               "mean_waiting": round(waiting, 2), "kv_usage_peak": round(kv_peak, 3),
               "preemptions": preempted}
    if steps <= 0:
        return Diagnosis("idle", f"no engine step in the last {window:.1f} s", "", numbers)
    if preempted > 0 or (waiting >= 0.5 and kv_peak >= KV_FULL):
        return _capacity(numbers, preempted, kv_peak, waiting)
    cap = last.max_num_seqs
    if cap and waiting >= 0.5 and max(s.running for s in samples) >= cap:
        return Diagnosis(
            "queueing", f"{waiting:.1f} requests wait on average while the batch is full at "
            f"--max-num-seqs {cap:.0f} (KV use peaks at {kv_peak:.0%}): the scheduler's cap "
            "bounds throughput, not the machine",
            "raise --max-num-seqs (the KV pool has room), or add replicas (--replicas)",
            numbers)
    return _roof_regime(first, last, window, numbers)


def _capacity(numbers: dict, preempted: float, kv_peak: float, waiting: float) -> Diagnosis:
    why = (f"{preempted:.0f} requests were preempted (their KV recomputed later)"
           if preempted else f"{waiting:.1f} requests wait on average for KV blocks")
    return Diagnosis(
        "capacity", f"{why}; the KV pool peaks at {kv_peak:.0%} use",
        "give the KV pool more memory (--kv-cache-memory-bytes or --num-kv-blocks), halve each "
        "token's KV (--kv-cache-dtype int8), spill to RAM (--kv-offload-ram-bytes), or admit "
        "fewer requests at once (--max-num-seqs)", numbers)


def _roof_regime(first: Sample, last: Sample, window: float, numbers: dict) -> Diagnosis:
    steps = last.steps - first.steps
    seconds = last.seconds - first.seconds
    tokens = last.tokens - first.tokens
    prefill = last.prefill_tokens - first.prefill_tokens
    bytes_, kv_bytes = last.bytes - first.bytes, last.kv_bytes - first.kv_bytes
    flops = last.flops - first.flops
    numbers.update(busy_fraction=round(seconds / window, 3),
                   tokens_per_step=round(tokens / steps, 2),
                   prefill_share=round(prefill / tokens, 3) if tokens else 0.0,
                   step_ms=round(1e3 * seconds / steps, 3))
    if not last.memory_gbps or not last.gemm_gflops or seconds <= 0:
        return Diagnosis("unknown", "the server measured no roof (--no-step-ledger, or a "
                         "format the cost model does not know)", "", numbers)
    memory_s = bytes_ / (last.memory_gbps * 1e9)
    compute_s = flops / (last.gemm_gflops * 1e9)
    rest_s = max(0.0, seconds - max(memory_s, compute_s))
    shares = {"bandwidth": memory_s / seconds, "compute": compute_s / seconds,
              "overhead": rest_s / seconds}
    numbers.update({f"{name}_share": round(share, 3) for name, share in shares.items()},
                   achieved_gbps=round(bytes_ / seconds / 1e9, 2),
                   achieved_gflops=round(flops / seconds / 1e9, 2),
                   roof_gbps=round(last.memory_gbps, 2), roof_gflops=round(last.gemm_gflops, 2),
                   kv_share_of_bytes=round(kv_bytes / bytes_, 3) if bytes_ else 0.0)
    regime = max(shares, key=shares.get)
    words = {"bandwidth": _bandwidth_words, "compute": _compute_words,
             "overhead": _overhead_words}[regime](numbers)
    return Diagnosis(regime, words[0], words[1], numbers)


def _bandwidth_words(n: dict) -> tuple[str, str]:
    kv = n["kv_share_of_bytes"]
    summary = (f"steps of {n['tokens_per_step']:g} tokens read {n['achieved_gbps']:g} GB/s "
               f"against {n['roof_gbps']:g} GB/s measured: moving the bytes takes "
               f"{n['bandwidth_share']:.0%} of the step ({kv:.0%} of the bytes are K/V)")
    if kv >= 0.5:
        return summary, ("the K/V reads dominate: --kv-cache-dtype int8 halves them; shorter "
                         "contexts or prefix sharing read less")
    return summary, ("every weight is read once per step: batch more requests per step (more "
                     "concurrency, --max-num-seqs), quantize the weights (--quantization int4), "
                     "or draft tokens to verify several per read (--speculative-config)")


def _compute_words(n: dict) -> tuple[str, str]:
    return (f"steps of {n['tokens_per_step']:g} tokens ({n['prefill_share']:.0%} prompt) run "
            f"{n['achieved_gflops']:g} GFLOP/s against {n['roof_gflops']:g} measured at the "
            f"model's GEMM shape: the FLOPs take {n['compute_share']:.0%} of the step",
            "prompts dominate: cache shared prefixes (--enable-prefix-caching), bound each "
            "step's prompt work (--max-num-batched-tokens) to keep decode smooth, move prefill "
            "to its own engine (--kv-transfer-config, P/D), or add replicas (--replicas)")


def _overhead_words(n: dict) -> tuple[str, str]:
    return (f"steps of {n['tokens_per_step']:g} tokens take {n['step_ms']:g} ms, of which the "
            f"bytes need {n['bandwidth_share']:.0%} and the FLOPs {n['compute_share']:.0%} at "
            f"this machine's roof: {n['overhead_share']:.0%} is per-step fixed cost "
            "(scheduling, Python, thread hand-offs, kernels below the roof)",
            "do more per step: more concurrent requests (--max-num-seqs), speculative decoding "
            "(--speculative-config); fewer threads per replica on a small model "
            "(--num-threads) with more replicas (--replicas)")
