"""Choose low-bit kernels by measurement on this machine: for each projection shape, time our
kernel (int4 layers, the int8 LM head) against the dense GEMM of the same weights at row counts
1..128 and keep the largest row count up to which ours wins.

Why: the crossover moves with the CPU. Measured with SmolLM2's shapes on one Zen 4: the bf16
int4 kernel beats the bf16 GEMM at every row count up to 128, while the AVX2 float32 one loses
from ~32 rows; a threshold tuned on one CPU is wrong on the next. Weights are timed as they
stream from DRAM (each call reads another of enough copies to exceed the L3), as in a decode
step: a matrix timed in a loop sits in cache and lies.

The table is cached on disk, keyed by the CPU model and flags, torch and kvserve versions, the
kernel ISA level and the thread count, so only the first start on a machine pays (a few
seconds, logged). `KVSERVE_AUTOTUNE=0` (or `--no-autotune`) turns it off; then the documented
fixed limits of kvserve/quant/linear.py apply.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kvserve.kernels import isa
from kvserve.kernels.cpu_load import neighbour_cores, read_cpu_sample, ticks_per_second
from kvserve.paths import cache_dir

logger = logging.getLogger(__name__)

AUTOTUNE_ENV = "KVSERVE_AUTOTUNE"
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Kernels that can beat the dense GEMM at prefill sizes too (w4a8's integer dot products: 1.5x
# the float32 GEMM at 512 rows on a Zen 3) are also timed at these; one that still wins at the
# last has no row limit (NO_LIMIT).
PREFILL_BUCKETS = (256, 512, 1024)
NO_LIMIT = 1 << 30
# From this many rows a call is compute-bound: a few copies of the weights are enough (streaming
# 64 MB at 1,024 rows would take seconds per shape).
COMPUTE_BOUND_ROWS = 256
STREAM_BYTES = 64 << 20  # more than any L3 we run on (32 MB)
# other processes' CPU time while timing, in cores, from which the timings are not kept: a
# neighbour on one of 2 cores stalls our parallel calls for whole time slices
MAX_NEIGHBOUR_CORES = 0.25
TABLE_VERSION = 4
_lock = threading.Lock()
_tables: dict[Path, dict] = {}


@dataclass(frozen=True)
class Choice:
    """One shape's measurements and the decision taken from them."""

    kind: str
    out_features: int
    in_features: int
    dtype: str
    isa: str
    rows: list[int]
    kernel_us: list[float]
    dense_us: list[float]
    max_rows: int  # our kernel up to this many rows, the dense GEMM above


def enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def set_enabled(value: bool) -> None:
    """The engine's `--no-autotune` switch (an environment variable, so worker processes and
    the kernels' start-up code see the same choice)."""
    os.environ[AUTOTUNE_ENV] = "1" if value else "0"


def table_path() -> Path:
    """One file per machine fingerprint: a change of CPU, torch, kvserve, the kernels' sources or
    threads re-tunes (a kernel changed within one kvserve version must not keep old limits)."""
    from kvserve import __version__
    from kvserve.kernels.cpu_ext import sources_digest

    cpu = isa.cpu_description()
    fingerprint = "|".join([cpu["model_name"], cpu["family"], cpu["model"],
                            " ".join(sorted(isa.cpu_flags())), torch.__version__, __version__,
                            sources_digest(), str(torch.get_num_threads()), str(TABLE_VERSION)])
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return cache_dir() / "autotune" / f"kernels-{digest}.json"


def _load(path: Path) -> dict:
    if path not in _tables:
        try:
            _tables[path] = json.loads(path.read_text())
        except (OSError, ValueError):  # absent or corrupt: re-measure
            _tables[path] = {}
    return _tables[path]


def _save(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    temporary.write_text(json.dumps(table, indent=1, sort_keys=True))
    temporary.replace(path)  # atomic: concurrent starts never read half a file


def _call_times_us(call: Callable[[int], object], copies: int, repeats: int = 3) -> list[float]:
    """Per-call times (sorted, microseconds) over `repeats` passes through the copies."""
    call(0)  # first-touch and one-time costs out of the timing
    times = []
    for _ in range(repeats):
        for i in range(copies):
            start = time.perf_counter()
            call(i)
            times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)


def _typical_us(times: list[float]) -> float:
    """The 10th percentile of per-call times. A busy neighbour process that deschedules one of
    our threads stalls a parallel call by a whole time slice (~4-8 ms measured on 2 cores), on
    most calls while it runs; a low percentile still sees the calls it spared, every one of
    which read its weights from DRAM."""
    return times[len(times) // 10]


def _contended(times: list[float]) -> bool:
    """Most calls far slower than the typical one: something else shares the cores."""
    return times[len(times) // 2] > 3 * _typical_us(times) + 50


def _implausible(times_by_rows: list[float]) -> bool:
    """A call on fewer rows far slower than one on more: every call of that bucket was stalled
    (a neighbour that runs throughout slows all calls alike, which `_contended` cannot see;
    measured: 9.8 ms at 1 row against 0.18 ms at 8)."""
    return any(earlier > 2 * later + 20 for i, earlier in enumerate(times_by_rows)
               for later in times_by_rows[i + 1:])


def _neighbours_busy(before, after) -> bool:
    """Other processes took more than MAX_NEIGHBOUR_CORES while we timed (False where /proc
    cannot be read)."""
    if before is None or after is None:
        return False
    return neighbour_cores(before, after, ticks_per_second()) > MAX_NEIGHBOUR_CORES


def _copies(tensor: torch.Tensor) -> list[torch.Tensor]:
    nbytes = tensor.numel() * tensor.element_size()
    return [tensor.clone() for _ in range(max(2, -(-STREAM_BYTES // max(1, nbytes))))]


def measure(kind: str, kernel: Callable, low_bit: torch.Tensor, dense: torch.Tensor,
            dtype: torch.dtype, level: str,
            buckets: tuple[int, ...] = ROW_BUCKETS) -> tuple[Choice, bool]:
    """Time `kernel(x, low_bit_copy, None, N)` against `F.linear(x, dense_copy)` per row bucket;
    stop once the dense GEMM has won twice in a row (the kernel's cost grows faster). Also says
    whether the cores were contended while timing."""
    out_features, in_features = dense.shape
    low_bits, denses = _copies(low_bit), _copies(dense)
    before = read_cpu_sample()
    rows_done, kernel_us, dense_us = [], [], []
    losses, contended = 0, False
    for rows in buckets:
        x = torch.randn(rows, in_features).to(dtype)
        copies = min(len(low_bits), 4) if rows >= COMPUTE_BOUND_ROWS else len(low_bits)
        ours = _call_times_us(lambda i: kernel(x, low_bits[i], None, out_features), copies)
        copies = min(len(denses), 4) if rows >= COMPUTE_BOUND_ROWS else len(denses)
        theirs = _call_times_us(lambda i: F.linear(x, denses[i]), copies)
        contended = contended or _contended(ours) or _contended(theirs)
        kernel_us.append(_typical_us(ours))
        dense_us.append(_typical_us(theirs))
        rows_done.append(rows)
        losses = losses + 1 if kernel_us[-1] >= dense_us[-1] else 0
        if losses == 2:
            break
    choice = Choice(kind, out_features, in_features, str(dtype).removeprefix("torch."), level,
                    rows_done, kernel_us, dense_us,
                    _max_winning_rows(rows_done, kernel_us, dense_us))
    contended = (contended or _neighbours_busy(before, read_cpu_sample())
                 or _implausible(kernel_us) or _implausible(dense_us))
    return choice, contended


def _max_winning_rows(rows: list[int], kernel_us: list[float], dense_us: list[float]) -> int:
    """The largest bucket up to which the kernel wins without interruption (0: never);
    NO_LIMIT when it wins at every prefill-sized bucket too."""
    best = 0
    for count, ours, theirs in zip(rows, kernel_us, dense_us):
        if ours >= theirs:
            return best
        best = count
    return NO_LIMIT if best == PREFILL_BUCKETS[-1] else best


def _key(kind: str, out_features: int, in_features: int, dtype: torch.dtype, level: str) -> str:
    return f"{kind}:{out_features}x{in_features}:{str(dtype).removeprefix('torch.')}:{level}"


def max_rows(kind: str, kernel: Callable, low_bit: torch.Tensor, dense: torch.Tensor,
             dtype: torch.dtype, level: str, fallback: int, prefill: bool = False) -> int:
    """Rows up to which `kernel` serves this shape: measured once per machine, then read from
    the table; `fallback` when autotuning is off. `prefill`: also time prefill-sized batches
    (PREFILL_BUCKETS); winning at every size gives NO_LIMIT."""
    if not enabled():
        return fallback
    key = _key(kind, dense.shape[0], dense.shape[1], dtype, level)
    path = table_path()
    with _lock:
        table = _load(path)
        if key not in table:
            start = time.perf_counter()
            buckets = ROW_BUCKETS + PREFILL_BUCKETS if prefill else ROW_BUCKETS
            choice, contended = measure(kind, kernel, low_bit, dense, dtype, level, buckets)
            table[key] = asdict(choice)
            if contended:  # used by this process only; the next start measures again
                logger.warning("autotune %s: another process was busy on these cores while "
                               "timing; not caching the choice", key)
            else:
                _save(path, table)
            logger.info("autotune %s: our kernel up to %d rows (%.1fs)", key, choice.max_rows,
                        time.perf_counter() - start)
        return int(table[key]["max_rows"])


def describe() -> str:
    """The table for `kvserve bench kernels`: one line per shape."""
    path = table_path()
    table = _load(path)
    state = "on" if enabled() else f"off ({AUTOTUNE_ENV}=0: fixed limits)"
    lines = [f"autotune: {state}; table {path} ({len(table)} shapes)"]
    for key in sorted(table):
        entry = table[key]
        pairs = ", ".join(f"{rows}: {ours:.0f}/{dense:.0f}" for rows, ours, dense in
                          zip(entry["rows"], entry["kernel_us"], entry["dense_us"]))
        lines.append(f"  {key}: ours up to {entry['max_rows']} rows (us ours/dense by rows: "
                     f"{pairs})")
    return "\n".join(lines)
