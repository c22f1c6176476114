"""Hardware profiles the planner predicts on: per-device memory, bandwidth, FLOPs per dtype and
interconnect, each number with its source, plus the engine's overheads on that hardware
(assumed for GPUs, measured for `this` machine: kvserve.bench.plan.calibrate)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from kvserve.engine_config import DEFAULT_STEP_TOKENS, DEFAULT_STEP_TOKENS_ELSEWHERE

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    kind: str  # "gpu" or "cpu"
    memory_bytes: float  # per device
    memory_gbps: float  # per device, peak (spec) or measured (this machine)
    gflops: dict[str, float]  # compute dtype -> dense peak GFLOP/s per device
    interconnect_gbps: float  # per device, one direction, within a node (0: none)
    network_gbps: float  # per device across nodes, one direction
    devices_per_node: int
    bandwidth_efficiency: float  # achievable fraction of memory_gbps
    flops_efficiency: float  # achievable fraction of gflops
    memory_fraction: float  # of memory_bytes an engine may use (vLLM's gpu_memory_utilization)
    engine_overhead_bytes: float  # per engine instance beyond weights and KV
    step_overhead_s: float  # fixed cost of one engine step (scheduler, inputs, sampling)
    seq_overhead_s: float  # per sequence in a decode step
    prefill_token_overhead_s: float  # per prompt token beyond the roofline's compute time
    collective_latency_s: float  # one all-reduce's fixed latency
    kv_dtypes: tuple[str, ...]
    quantizations: tuple[str, ...]
    # the engine's default token budget a step (max_num_batched_tokens) on this kind
    step_tokens: int = DEFAULT_STEP_TOKENS_ELSEWHERE
    # once per step that computes prompt tokens, beyond step_overhead_s (a prefill's per-layer
    # work that does not grow with its tokens)
    prefill_step_overhead_s: float = 0.0
    # once per request, outside the engine's steps: the API server's path (HTTP, tokenizing,
    # detokenizing, the stream), which a lone request's TTFT pays beyond its prefill
    request_overhead_s: float = 0.0
    # once per request of a prefill/decode pair beyond its KV's bytes: the router's second hop
    # and the connectors' handshake and pull (0: not measured; `plan --validate` measures it on
    # its P/D pair)
    kv_handoff_overhead_s: float = 0.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # "weights/kv" -> the overheads above (OVERHEAD_FIELDS), measured for that format (`this`
    # machine: each format runs its own kernels); a format not in it takes the scalars
    format_overheads: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict:
        return asdict(self)

    def overheads(self, quantization: str, kv_dtype: str) -> Overheads:
        """The engine's overheads for a weight format and KV dtype: measured for exactly that
        pair, else for the weights with bf16 KV, else the profile's own."""
        table = self.format_overheads
        found = table.get(f"{quantization}/{kv_dtype}") or table.get(f"{quantization}/bfloat16")
        source = found or {name: getattr(self, name) for name in OVERHEAD_FIELDS}
        return Overheads(*(source.get(name, 0.0) for name in OVERHEAD_FIELDS))


OVERHEAD_FIELDS = ("step_overhead_s", "seq_overhead_s", "prefill_step_overhead_s",
                   "prefill_token_overhead_s", "request_overhead_s", "kv_handoff_overhead_s")


@dataclass(frozen=True)
class Overheads:
    """Seconds beyond the roofline's time: per step, per decoding sequence, per step with
    prompt tokens, per prompt token, per request outside the steps (the API server), and per
    request handed from a prefill to a decode instance beyond its KV's bytes."""
    step_s: float
    seq_s: float
    prefill_step_s: float
    prefill_token_s: float
    request_s: float = 0.0
    handoff_s: float = 0.0


_NVIDIA_OVERHEADS = dict(
    bandwidth_efficiency=0.8, flops_efficiency=0.6, memory_fraction=0.9,
    engine_overhead_bytes=4 * GIB, step_overhead_s=1.5e-3, seq_overhead_s=5e-6,
    prefill_token_overhead_s=0.0, collective_latency_s=10e-6, devices_per_node=8,
    network_gbps=50.0, kv_dtypes=("bfloat16", "fp8"),
    quantizations=("none", "fp8", "int8", "int4"))

_GPU_ASSUMPTIONS = {
    "bandwidth_efficiency": "assumed: ~80% of HBM peak is what decode GEMV kernels reach",
    "flops_efficiency": "assumed: ~60% of dense tensor peak for prefill GEMMs",
    "memory_fraction": "vLLM's default gpu_memory_utilization 0.9",
    "engine_overhead_bytes": "assumed: CUDA context, graphs and activations, 4 GiB a device",
    "step_overhead_s": "assumed: 1.5 ms per step of scheduling, input prep and sampling with "
                       "CUDA graphs (not measured: no GPU here)",
    "collective_latency_s": "assumed: ~10 us per NCCL/RCCL all-reduce of a decode step",
    "network_gbps": "one 400 Gb/s InfiniBand NDR / RoCE NIC per GPU (50 GB/s)",
}

H100_SXM = Hardware(
    name="h100-sxm", kind="gpu", memory_bytes=80e9, memory_gbps=3350.0,
    gflops={"bfloat16": 989_400.0, "fp8": 1_978_900.0, "int8": 1_978_900.0},
    interconnect_gbps=450.0, **_NVIDIA_OVERHEADS,
    sources={"spec": "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB HBM3, "
                     "3.35 TB/s, BF16 989 TFLOPS and FP8 1,979 TFLOPS dense (the sheet's "
                     "figures are with sparsity, twice these), NVLink 900 GB/s both "
                     "directions)", **_GPU_ASSUMPTIONS})

H200 = replace(
    H100_SXM, name="h200", memory_bytes=141e9, memory_gbps=4800.0,
    sources={"spec": "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB "
                     "HBM3e, 4.8 TB/s, the H100's compute: BF16 989 / FP8 1,979 TFLOPS dense, "
                     "NVLink 900 GB/s both directions)", **_GPU_ASSUMPTIONS})

MI300X = replace(
    H100_SXM, name="mi300x", memory_bytes=192e9, memory_gbps=5300.0,
    gflops={"bfloat16": 1_307_400.0, "fp8": 2_614_900.0, "int8": 2_614_900.0},
    interconnect_gbps=448.0,
    sources={"spec": "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html "
                     "(192 GB HBM3, 5.3 TB/s, BF16 1,307.4 / FP8 2,614.9 TFLOPS dense, "
                     "Infinity Fabric 896 GB/s aggregate both directions: 448 one way)",
             **_GPU_ASSUMPTIONS})

# A 2-core VM as this project's machines are (Intel Xeon family 6 model 207, AMX): the median
# of the saved `kvserve bench roofline` runs on it (benchmarks/results/intel-r-xeon-r-processor-
# f6-m207/*/roofline.json: 18.7-21.6 GB/s, bf16 728 GFLOP/s at a 1B model's MLP shape); the
# engine's overheads as `--hardware this` measured them on SmolLM2 on 2026-11-30 (sources).
CPU_2CORE = Hardware(
    name="cpu-2core", kind="cpu", memory_bytes=23 * GIB, memory_gbps=20.3,
    gflops={"bfloat16": 728.0, "float32": 188.0}, interconnect_gbps=0.0, network_gbps=1.25,
    devices_per_node=1, bandwidth_efficiency=1.0, flops_efficiency=1.0, memory_fraction=0.8,
    engine_overhead_bytes=1 * GIB, step_overhead_s=2.5e-3, seq_overhead_s=0.29e-3,
    prefill_token_overhead_s=0.51e-3, collective_latency_s=0.0,
    kv_dtypes=("bfloat16", "int8"), quantizations=("none", "int8", "int4"),
    step_tokens=DEFAULT_STEP_TOKENS["cpu"],
    sources={"memory_gbps": "median of saved roofline.json runs on this VM type",
             "gflops": "saved roofline.json (bf16 AMX GEMM at a 1B model's MLP shape)",
             "memory_bytes": "this VM's RAM (free -g: 23 GiB)",
             "memory_fraction": "assumed: leave 20% of RAM to the OS and other processes",
             "engine_overhead_bytes": "kvserve RSS minus file size, 0.55-1.07 GiB "
                                      "(benchmarks/results/intel-r-xeon-r-processor-f6-m207/"
                                      "startup-memory-torchfree.md)",
             "step_overhead_s": "--hardware this calibration on SmolLM2, 2026-11-30 23:08 UTC, "
                                "load 1.65 (step 2.5 ms, 0.29 ms a sequence, 0.51 ms a "
                                "prompt token; offline engine steps of the default format, "
                                "before calibration became per format and served)",
             "efficiency": "1.0: the figures are measured achievable rates, not peaks"})

PROFILES = {h.name: h for h in (H100_SXM, H200, MI300X, CPU_2CORE)}
ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200"}


def named_profile(name: str) -> Hardware:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PROFILES:
        from kvserve.bench.plan.shapes import PlanInputError

        raise PlanInputError(f"unknown hardware {name!r}: this, {', '.join(PROFILES)}")
    return PROFILES[key]
