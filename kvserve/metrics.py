"""Prometheus metrics with vLLM-style names (`kvserve:` instead of `vllm:`).

Gauges are sampled from the engine after every step; counters and histograms are fed per step and
per request by the AsyncEngine. prometheus_client is thread-safe, so the engine thread writes and
the HTTP thread renders without locks of ours.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvserve.bottleneck import COUNTERS, REGIMES, Diagnosis, Sample, diagnose

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
DOCTOR_WINDOW_S = 5.0  # the bottleneck regime /metrics and /doctor show: over the last 5 s
_DOCTOR_SAMPLE_S = 0.2  # at most one kept sample per 0.2 s of stats messages
# the step ledger's totals (SchedulerStats field -> Sample field): counters in /metrics
_LEDGER_FIELDS = {"step_count": "steps", "step_seconds": "seconds", "step_tokens": "tokens",
                  "step_prefill_tokens": "prefill_tokens", "step_flops": "flops",
                  "step_bytes": "bytes", "step_kv_bytes": "kv_bytes"}


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"kvserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"kvserve:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"kvserve:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        # agent sessions (requests naming a session): their own hit rate, and what is kept
        self.session_queries = counter("session_prefix_cache_queries",
                                       "Prompt tokens of requests naming a session looked up")
        self.session_hits = counter("session_prefix_cache_hits",
                                    "Of those, prompt tokens found in the prefix cache")
        self.pinned_blocks = gauge("kv_session_pinned_blocks",
                                   "Free KV blocks kept for recent sessions")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.preemptions = counter("num_preemptions", "Requests preempted")
        # speculative decoding (vLLM's spec_decode counters)
        self.spec_drafts = counter("spec_decode_num_drafts", "Verification steps with drafts")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted")
        self._spec_per_position = Counter(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft", labels + ["position", "method"],
            registry=r)
        self._last_per_position: list[int] = []
        # mixtures of experts: tokens routed to each expert of each MoE layer (a token counts
        # once per expert of its top k), for load balance and to see which experts run
        self._expert_tokens = Counter(
            "kvserve:moe_expert_routed_tokens", "Tokens routed to each expert, by MoE layer",
            labels + ["layer", "expert"], registry=r)
        self._last_experts: dict[int, list[int]] = {}
        self._init_doctor(model_name, gauge, counter)
        self._success = Counter("kvserve:request_success", "Finished requests by reason",
                                labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens of a request",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled",
                                    _LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length", _TOKEN_BUCKETS)
        self.output_len = histogram("request_generation_tokens", "Output length", _TOKEN_BUCKETS)
        self._last = {"queries": 0, "hits": 0, "preemptions": 0, "drafts": 0,
                      "draft_tokens": 0, "accepted": 0, "session_queries": 0,
                      "session_hits": 0}

    def _init_doctor(self, model_name: str, gauge, counter) -> None:
        """The step ledger's counters, the roof, and the doctor's regime (one gauge per
        regime, 1 for the current one), with the samples of the window it is read over."""
        docs = {"steps": "Engine steps that ran a batch",
                "seconds": "Wall time of those steps in the engine core",
                "tokens": "Tokens those steps computed",
                "prefill_tokens": "Of those, prompt tokens",
                "flops": "FLOPs those steps did (estimated from the model's shape)",
                "bytes": "Bytes those steps read and wrote (weights once per step, K/V)",
                "kv_bytes": "Of those, K/V bytes"}
        self._ledger = {key: counter(COUNTERS[key].removeprefix("kvserve:")
                                     .removesuffix("_total"), doc)
                        for key, doc in docs.items()}
        self.roof_gbps = gauge("roofline_memory_gbps", "This machine's measured memory "
                               "bandwidth (GB/s), the doctor's roof")
        self.roof_gflops = gauge("roofline_gemm_gflops", "This machine's measured GEMM rate at "
                                 "the model's shape and dtype (GFLOP/s)")
        self.max_num_seqs = gauge("scheduler_max_num_seqs", "The scheduler's cap on running "
                                  "requests (--max-num-seqs)")
        regime = Gauge("kvserve:bottleneck_regime", "What bounds the engine over the last "
                       f"{DOCTOR_WINDOW_S:g} s (1: this regime), see /doctor",
                       ["model_name", "regime"], registry=self.registry)
        self._regimes = {name: regime.labels(model_name, name)
                         for name in REGIMES + ("unknown",)}
        self._samples: deque[Sample] = deque()
        self._latest = Sample(time.monotonic())
        # the engine's output thread records, the HTTP thread diagnoses: the window is shared
        self._samples_lock = threading.Lock()

    def record_engine_state(self, stats) -> None:
        """Gauges and counter deltas from the core's latest SchedulerStats. A restarted core
        counts from zero again: the counters only ever move forward."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.pinned_blocks.set(stats.num_pinned_blocks)
        for key, value, counter in (("queries", stats.prefix_queries, self.prefix_queries),
                                    ("hits", stats.prefix_hits, self.prefix_hits),
                                    ("session_queries", stats.session_queries,
                                     self.session_queries),
                                    ("session_hits", stats.session_hits, self.session_hits),
                                    ("preemptions", stats.num_preemptions, self.preemptions),
                                    ("drafts", stats.spec_drafts, self.spec_drafts),
                                    ("draft_tokens", stats.spec_draft_tokens,
                                     self.spec_draft_tokens),
                                    ("accepted", stats.spec_accepted_tokens,
                                     self.spec_accepted_tokens)):
            if value > self._last[key]:
                counter.inc(value - self._last[key])
            self._last[key] = value
        self._record_ledger(stats)
        if stats.spec_accepted_per_position:
            self._record_spec_positions(stats)
        if stats.expert_counts:
            self._record_expert_counts(stats.expert_counts)

    def _record_ledger(self, stats) -> None:
        """The ledger's counter deltas, the roof, and a sample for the doctor's window."""
        latest = Sample(time.monotonic(), preemptions=stats.num_preemptions,
                        running=stats.num_running, waiting=stats.num_waiting,
                        kv_usage=stats.kv_usage, memory_gbps=stats.roof_memory_gbps,
                        gemm_gflops=stats.roof_gemm_gflops, max_num_seqs=stats.max_num_seqs,
                        **{key: getattr(stats, name) for name, key in _LEDGER_FIELDS.items()})
        with self._samples_lock:
            if latest.steps < self._latest.steps:  # a restarted core counts from zero
                self._samples.clear()
                self._latest = Sample(latest.time)
            for key, counter in self._ledger.items():
                delta = getattr(latest, key) - getattr(self._latest, key)
                if delta > 0:
                    counter.inc(delta)
            self._latest = latest
            if not self._samples or latest.time - self._samples[-1].time >= _DOCTOR_SAMPLE_S:
                self._samples.append(latest)
            self._prune(latest.time)
        self.roof_gbps.set(latest.memory_gbps)
        self.roof_gflops.set(latest.gemm_gflops)
        self.max_num_seqs.set(latest.max_num_seqs)

    def _prune(self, now: float) -> None:
        """Drop samples older than the window, but the last of them: it is the baseline of the
        steps that ended inside the window (a step longer than the window still counts)."""
        samples = self._samples
        while len(samples) >= 2 and now - samples[1].time > DOCTOR_WINDOW_S:
            samples.popleft()

    def diagnosis(self) -> Diagnosis:
        """The doctor's reading of the last DOCTOR_WINDOW_S seconds (now included: an engine
        that stopped stepping reads idle once its last step leaves the window)."""
        with self._samples_lock:
            now = time.monotonic()
            self._prune(now)
            current = Sample(now, **{k: v for k, v in vars(self._latest).items()
                                     if k != "time"})
            baseline = list(self._samples) or [Sample(now - DOCTOR_WINDOW_S, **{
                k: v for k, v in vars(current).items() if k != "time"})]
        diagnosis = diagnose(baseline + [current])
        for name, gauge in self._regimes.items():
            gauge.set(1.0 if name == diagnosis.regime else 0.0)
        return diagnosis

    def _record_expert_counts(self, counts: dict[int, list[int]]) -> None:
        """Each MoE layer's per-expert routed tokens (cumulative in the core): the increase
        since the last report (a restarted core counts from zero: taken as a fresh start)."""
        for layer, experts in counts.items():
            last = self._last_experts.get(layer) or [0] * len(experts)
            if sum(experts) < sum(last):
                last = [0] * len(experts)
            for expert, (value, before) in enumerate(zip(experts, last)):
                if value > before:
                    self._expert_tokens.labels(self.model_name, str(layer),
                                               str(expert)).inc(value - before)
            self._last_experts[layer] = list(experts)

    def _record_spec_positions(self, stats) -> None:
        counts = stats.spec_accepted_per_position
        last = self._last_per_position + [0] * (len(counts) - len(self._last_per_position))
        for position, (value, before) in enumerate(zip(counts, last)):
            if value > before:
                self._spec_per_position.labels(self.model_name, str(position),
                                               stats.spec_method).inc(value - before)
        self._last_per_position = list(counts) if sum(counts) >= sum(last) else []

    def record_aborted(self) -> None:
        self._success.labels(self.model_name, "abort").inc()

    def record_failed(self) -> None:
        """A request the engine failed (an exception of its own); label "error"."""
        self._success.labels(self.model_name, "error").inc()

    def record_finished(self, output, num_output_tokens: int) -> None:
        """A finished request: `num_output_tokens` is counted by the caller, since its final
        output may carry only the last delta."""
        metrics = output.metrics
        if isinstance(output.outputs, list):
            reason = next((o.finish_reason for o in output.outputs if o.finish_reason), "abort")
        else:  # a pooling request's one vector: it finished with its prompt
            reason = "stop"
        self._success.labels(self.model_name, reason).inc()
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.queue_time is not None:
            self.queue_time.observe(metrics.queue_time)
        self.prompt_len.observe(len(output.prompt_token_ids))
        self.output_len.observe(num_output_tokens)

    def render(self) -> bytes:
        self.diagnosis()  # the regime gauges, as of this scrape
        return generate_latest(self.registry)
