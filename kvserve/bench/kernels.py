"""`kvserve bench kernels`: the kernel ISA level in use, what the CPU offers, the autotune table
where one is built, and F.linear's time at one row for SmolLM2's projection shapes. Weights stream
from DRAM as in a decode step: each timed pass rotates over copies of a matrix that together
exceed any L3 we run on, so no copy is still cached when its turn comes again.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from kvserve.kernels import isa
from kvserve.platform import cpu_has_native_bf16

# (projection, in_features K, out_features N) of SmolLM2-135M; qkv is 576 + 2 x 192 outputs
SMOLLM2_SHAPES = (("qkv_proj", 576, 960), ("o_proj", 576, 576), ("gate_up_proj", 576, 3072),
                  ("down_proj", 1536, 576), ("lm_head", 576, 49152))
STREAM_BYTES = 64 * 2**20
TIMED_PASSES = 3


def stream_copies(matrix_bytes: int, stream_bytes: int = STREAM_BYTES) -> int:
    """How many copies of a matrix to rotate over so that one pass reads more than stream_bytes."""
    return stream_bytes // matrix_bytes + 1


def time_linear_m1(in_features: int, out_features: int, dtype: torch.dtype) -> float:
    """Best mean seconds of F.linear(x[1, K], W[N, K]) over passes across streamed copies."""
    matrix_bytes = in_features * out_features * torch.finfo(dtype).bits // 8
    weights = torch.randn(stream_copies(matrix_bytes), out_features, in_features).to(dtype)
    x = torch.randn(1, in_features).to(dtype)
    best = float("inf")
    for timed_pass in range(TIMED_PASSES + 1):  # the first pass warms code paths, untimed
        start = time.perf_counter()
        for weight in weights:
            F.linear(x, weight)
        seconds = (time.perf_counter() - start) / len(weights)
        best = min(best, seconds) if timed_pass else best
    return best


def linear_table(dtypes: list[torch.dtype]) -> list[str]:
    """Markdown rows: microseconds and effective GB/s of each shape in each dtype."""
    names = [str(dtype).removeprefix("torch.") for dtype in dtypes]
    header = "| projection | K x N | " + " | ".join(f"{n} us | {n} GB/s" for n in names) + " |"
    lines = [header, "|" + "---|" * (2 + 2 * len(dtypes))]
    for projection, in_features, out_features in SMOLLM2_SHAPES:
        cells = []
        for dtype in dtypes:
            seconds = time_linear_m1(in_features, out_features, dtype)
            matrix_bytes = in_features * out_features * torch.finfo(dtype).bits // 8
            cells += [f"{seconds * 1e6:.1f}", f"{matrix_bytes / seconds / 1e9:.1f}"]
        lines.append(f"| {projection} | {in_features} x {out_features} | "
                     + " | ".join(cells) + " |")
    return lines


def autotune_description() -> str:
    """The autotuner's table for this machine (empty until an engine has started here)."""
    from kvserve.kernels import autotune

    return autotune.describe()


def isa_lines() -> list[str]:
    cpu = isa.cpu_description()
    cap = os.environ.get(isa.ISA_ENV)
    return [
        f"CPU: {cpu['model_name']} (family {cpu['family']}, model {cpu['model']})",
        f"kernel ISA level in use: {isa.selected_level()} "
        f"({isa.ISA_ENV}={cap if cap else 'unset'})",
        f"machine's levels: {', '.join(isa.machine_levels())}",
        f"native bf16 GEMMs: {'yes' if cpu_has_native_bf16() else 'no (emulated by torch)'}",
    ]


def kernels_report() -> dict:
    """Everything `bench kernels` prints, measured now (a few seconds)."""
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_has_native_bf16() else [])
    return {"isa": isa_lines(), "autotune": autotune_description(),
            "linear_m1": linear_table(dtypes), "threads": torch.get_num_threads()}


def print_kernels_report(report: dict) -> None:
    print("\n".join(report["isa"]))
    print(report["autotune"])
    print(f"\nF.linear at M = 1, weights streamed from DRAM ({STREAM_BYTES >> 20} MB+ per pass), "
          f"{report['threads']} threads:")
    print("\n".join(report["linear_m1"]))
