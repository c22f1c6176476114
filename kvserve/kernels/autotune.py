"""Choose low-bit kernels by measurement on this machine: for each projection shape, time our
kernel (int4 layers, the int8 LM head) against the dense GEMM of the same weights at row counts
1..128 and keep the largest row count up to which ours wins.

Why: the crossover moves with the CPU. Measured with SmolLM2's shapes on one Zen 4: the bf16
int4 kernel beats the bf16 GEMM at every row count up to 128, while the AVX2 float32 one loses
from ~32 rows; a threshold tuned on one CPU is wrong on the next. Weights are timed as they
stream from DRAM (each call reads another of enough copies to exceed the L3), as in a decode
step: a matrix timed in a loop sits in cache and lies.

Start-up never waits for it. A shape the table (cached on disk, keyed by the CPU model and
flags, torch and kvserve versions, the kernels' sources and the thread count) already holds is
read from it; any other serves at once with the documented fixed limit of kvserve/quant/linear.py
and is measured later by a background thread, while this process has run no step for a moment
and other processes leave the cores idle. A measurement a step or a neighbour interrupted is
retried later (backing off), never kept; a clean one is saved and reaches the layers at the
start of the next step (`step_started`), which also tells the model to rebuild its decode stack.
Measured on a 2-core Xeon (Cascade Lake) beside a busy neighbour: tuning at start-up, which
refused contended timings, made every start of the bundled 135M model take 94-128 s.

`KVSERVE_AUTOTUNE=0` (or `--no-autotune`) turns it off (the fixed limits apply);
`KVSERVE_AUTOTUNE=blocking` measures during construction, as a benchmark of the tuned
choices wants.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kvserve.kernels import isa
from kvserve.kernels.cpu_load import neighbour_cores, read_cpu_sample, ticks_per_second
from kvserve.kernels.omp_teams import run_in_transient_thread
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
# the background tuner: this process idle this long (no step) and neighbours below
# MAX_NEIGHBOUR_CORES over one sample before it measures; an interrupted measurement waits
# RETRY_SECONDS, doubling per failure up to MAX_RETRY_SECONDS
IDLE_SECONDS = 1.0
IDLE_SAMPLE_SECONDS = 0.5
RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 600.0
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


def blocking() -> bool:
    """`KVSERVE_AUTOTUNE=blocking`: measure while the layers are built (the old behaviour)."""
    return os.environ.get(AUTOTUNE_ENV, "").strip().lower() == "blocking"


def set_enabled(value: bool) -> None:
    """The engine's `--no-autotune` switch (an environment variable, so worker processes and
    the kernels' start-up code see the same choice)."""
    os.environ[AUTOTUNE_ENV] = "1" if value else "0"


def table_path() -> Path:
    """One file per machine fingerprint: a change of CPU, torch, kvserve, the kernels' sources or
    threads or the AMX or super-block switch re-tunes (a kernel changed within one kvserve
    version must not keep old limits)."""
    from kvserve import __version__
    from kvserve.kernels.cpu_ext import sources_digest

    cpu = isa.cpu_description()
    fingerprint = "|".join([cpu["model_name"], cpu["family"], cpu["model"],
                            " ".join(sorted(isa.cpu_flags())), torch.__version__, __version__,
                            sources_digest(), str(torch.get_num_threads()), str(TABLE_VERSION),
                            "amx=" + os.environ.get("KVSERVE_AMX", ""),
                            "superblocks=" + os.environ.get("KVSERVE_GGUF_SUPERBLOCKS", "")])
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


class _Interrupted(Exception):
    """A step started while timing: the background tuner gives the cores back at once."""


def _call_times_us(call: Callable[[int], object], copies: int, repeats: int = 3,
                   interrupted: Callable[[], bool] = lambda: False) -> list[float]:
    """Per-call times (sorted, microseconds) over `repeats` passes through the copies; raises
    _Interrupted as soon as `interrupted()` (checked between calls: a served step waits for
    one call at most)."""
    call(0)  # first-touch and one-time costs out of the timing
    times = []
    for _ in range(repeats):
        for i in range(copies):
            if interrupted():
                raise _Interrupted
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
    """Enough copies of the weights that cycling through them reads DRAM, as serving does. A
    tensor of STREAM_BYTES or more evicts itself: it is timed as it is, never cloned (the
    clones of a 128K-vocab head were a transient of twice its bytes during start-up)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= STREAM_BYTES:
        return [tensor, tensor]
    return [tensor.clone() for _ in range(max(2, -(-STREAM_BYTES // max(1, nbytes))))]


def measure(kind: str, kernel: Callable, low_bit: torch.Tensor, dense: torch.Tensor,
            dtype: torch.dtype, level: str, buckets: tuple[int, ...] = ROW_BUCKETS,
            interrupted: Callable[[], bool] = lambda: False,
            rival: Callable | None = None) -> tuple[Choice, bool]:
    """Time `kernel(x, low_bit_copy, None, N)` against `F.linear(x, dense_copy)` per row bucket
    (or, given `rival`, against `rival(x, low_bit_copy)`: another kernel on the same weights,
    `dense` then only their shape); stop once the rival has won twice in a row (the kernel's
    cost grows faster). Also says whether the cores were contended while timing;
    `interrupted()` true between timed calls stops early and counts as contended."""
    out_features, in_features = dense.shape
    low_bits = _copies(low_bit)
    denses = low_bits if rival is not None else _copies(dense)
    against = rival if rival is not None else F.linear
    before = read_cpu_sample()
    rows_done, kernel_us, dense_us = [], [], []
    losses, contended = 0, False
    for rows in buckets:
        if interrupted():
            contended = True
            break
        x = torch.randn(rows, in_features).to(dtype)
        copies = min(len(low_bits), 4) if rows >= COMPUTE_BOUND_ROWS else len(low_bits)
        try:
            ours = _call_times_us(lambda i: kernel(x, low_bits[i], None, out_features), copies,
                                  interrupted=interrupted)
            copies = min(len(denses), 4) if rows >= COMPUTE_BOUND_ROWS else len(denses)
            theirs = _call_times_us(lambda i: against(x, denses[i]), copies,
                                    interrupted=interrupted)
        except _Interrupted:
            contended = True
            break
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
             dtype: torch.dtype, level: str, fallback: int, prefill: bool = False,
             owner: object | None = None, rival: Callable | None = None) -> int:
    """Rows up to which `kernel` serves this shape, at once: the table's value, else `fallback`
    while the shape waits for the background tuner, whose result is later set as
    `owner.max_rows` (at the start of a step). `prefill`: also time prefill-sized batches
    (PREFILL_BUCKETS); winning at every size gives NO_LIMIT. `rival`: the call serving larger
    batches when it is not the dense GEMM (`measure`; `dense` is then a meta tensor of the
    weights' shape)."""
    if not enabled():
        return fallback
    key = _key(kind, dense.shape[0], dense.shape[1], dtype, level)
    path = table_path()
    buckets = ROW_BUCKETS + PREFILL_BUCKETS if prefill else ROW_BUCKETS
    args = (kind, kernel, low_bit, dense, dtype, level, buckets)
    with _lock:
        table = _load(path)
        if key in table:
            return int(table[key]["max_rows"])
        if blocking():
            return _measure_now(path, table, key, args, rival)
    _tuner().submit(path, key, args, owner, rival)
    return fallback


def _measure_now(path: Path, table: dict, key: str, args: tuple, rival) -> int:
    """Blocking mode: measure during construction; a contended result serves this process but
    is not saved."""
    start = time.perf_counter()
    choice, contended = measure(*args, rival=rival)
    table[key] = asdict(choice)
    if contended:
        logger.warning("autotune %s: another process was busy on these cores while timing; "
                       "not caching the choice", key)
    else:
        _save(path, table)
    logger.info("autotune %s: our kernel up to %d rows (%.1fs)", key, choice.max_rows,
                time.perf_counter() - start)
    return choice.max_rows


def step_started() -> int:
    """Called by the model at the start of every step, on its own thread: marks this process
    busy until `step_finished` (the tuner waits for IDLE_SECONDS of quiet after it) and hands
    finished measurements to their layers. Returns the generation of the limits: a change means
    a decode stack built with the old ones must be rebuilt."""
    global _last_step, _steps_running
    with _steps_lock:
        _last_step = time.monotonic()
        _steps_running += 1
    tuner = _background
    if tuner is not None and tuner.finished:
        tuner.apply_finished()
    return _generation


def step_finished() -> None:
    """Called by the model when a step's forward ends (raised or not). Why: quiet was counted
    from a step's start, so a prefill step longer than IDLE_SECONDS (a 512-token prompt of a 3B
    model: ~3 s on 2 cores) looked idle halfway and the tuner timed its shapes beside it (that
    prefill took 4.3 s instead of 3.0)."""
    global _last_step, _steps_running
    with _steps_lock:
        _steps_running = max(0, _steps_running - 1)
        _last_step = time.monotonic()


def _stepping_since(started: float) -> bool:
    """A step is running, or one ran after `started`."""
    return _steps_running > 0 or _last_step > started


def generation() -> int:
    """How many times measured limits have reached layers in this process."""
    return _generation


def pending() -> int:
    """Shapes the background tuner has yet to measure (for tests and `bench kernels`)."""
    return 0 if _background is None else _background.pending()


_last_step = 0.0  # time.monotonic() of the latest step_started or step_finished
_steps_running = 0  # model forwards under way (pipeline stages may nest on one thread)
_steps_lock = threading.Lock()  # workers on threads of one process count steps together
_generation = 0  # bumped whenever measured limits reach layers
_background: "_BackgroundTuner | None" = None


@dataclass
class _Job:
    """One shape to measure, and the layers that take its result."""

    path: Path
    key: str
    args: tuple
    owners: list  # weak references to the layers whose max_rows the result sets
    rival: Callable | None = None
    not_before: float = 0.0
    failures: int = 0


class _BackgroundTuner:
    """A daemon thread that measures pending shapes one at a time while the process and its
    neighbours are idle; results wait in `finished` until a step starts (the model's thread
    sets its layers' limits, never this one mid-step)."""

    def __init__(self):
        self.jobs: dict[str, _Job] = {}
        self.finished: list[tuple[_Job, int]] = []
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="kvserve-autotune", daemon=True)
        self.thread.start()
        # a daemon thread still inside a torch op when the interpreter exits aborts the process
        # ("terminate called without an active exception"): stop it first
        atexit.register(self.stop)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the call being timed, if any (pending shapes stay unmeasured)."""
        with self.wake:
            self.stopping = True
            self.wake.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def submit(self, path: Path, key: str, args: tuple, owner: object | None,
               rival: Callable | None = None) -> None:
        with self.wake:
            job = self.jobs.get(key)
            if job is None:
                job = self.jobs[key] = _Job(path, key, args, [], rival=rival)
            if owner is not None:
                job.owners.append(weakref.ref(owner))
            self.wake.notify()

    def pending(self) -> int:
        with self.wake:
            return len(self.jobs)

    def apply_finished(self) -> None:
        global _generation
        with self.wake:
            finished, self.finished = self.finished, []
        for job, rows in finished:
            for ref in job.owners:
                layer = ref()
                if layer is not None:
                    layer.max_rows = rows
        _generation += 1

    def _run(self) -> None:
        while not self.stopping:
            job = self._next_job()
            if job is None:
                return
            if not _idle():
                time.sleep(IDLE_SAMPLE_SECONDS)
                continue
            self._measure(job)

    def _next_job(self) -> _Job | None:
        """The job whose retry time comes first, once it has come (sleeps until then); None
        when stopping."""
        with self.wake:
            while not self.stopping:
                if self.jobs:
                    job = min(self.jobs.values(), key=lambda j: j.not_before)
                    wait = job.not_before - time.monotonic()
                    if wait <= 0:
                        return job
                    self.wake.wait(wait)
                else:
                    self.wake.wait()
            return None

    def _measure(self, job: _Job) -> None:
        started = time.monotonic()
        try:
            # every core, from a thread that then exits: a tuner thread holding an OpenMP team
            # of its own would throttle the steps' workers for good (kernels/omp_teams.py)
            choice, contended = run_in_transient_thread(lambda: measure(
                *job.args, interrupted=lambda: self.stopping or _stepping_since(started),
                rival=job.rival), name="kvserve-autotune-measure")
        except Exception:  # a kernel that fails here fails in the model too; keep the fallback
            logger.exception("autotune %s: measuring failed; keeping the fixed limit", job.key)
            with self.wake:
                self.jobs.pop(job.key, None)
            return
        if self.stopping:
            return
        if contended or _stepping_since(started):
            job.failures += 1
            job.not_before = time.monotonic() + min(MAX_RETRY_SECONDS,
                                                    RETRY_SECONDS * 2 ** (job.failures - 1))
            logger.info("autotune %s: interrupted by a step or a busy neighbour; retrying in "
                        "%.0fs", job.key, job.not_before - time.monotonic())
            return
        with _lock:
            table = _load(job.path)
            table[job.key] = asdict(choice)
            _save(job.path, table)
        logger.info("autotune %s: our kernel up to %d rows (measured in the background, %.1fs)",
                    job.key, choice.max_rows, time.monotonic() - started)
        with self.wake:
            self.jobs.pop(job.key, None)
            self.finished.append((job, choice.max_rows))


def _idle() -> bool:
    """No step for IDLE_SECONDS and other processes below MAX_NEIGHBOUR_CORES over a sample
    (sleeps for the sample)."""
    if _steps_running or time.monotonic() - _last_step < IDLE_SECONDS:
        return False
    before = read_cpu_sample()
    time.sleep(IDLE_SAMPLE_SECONDS)
    return not _neighbours_busy(before, read_cpu_sample()) and not _steps_running and \
        time.monotonic() - _last_step >= IDLE_SECONDS


def _tuner() -> _BackgroundTuner:
    global _background
    with _lock:
        if _background is None:
            _background = _BackgroundTuner()
        return _background


def describe() -> str:
    """The table for `kvserve bench kernels`: one line per shape."""
    path = table_path()
    table = _load(path)
    state = ("blocking" if blocking() else "on") if enabled() \
        else f"off ({AUTOTUNE_ENV}=0: fixed limits)"
    lines = [f"autotune: {state}; table {path} ({len(table)} shapes, {pending()} pending)"]
    for key in sorted(table):
        entry = table[key]
        pairs = ", ".join(f"{rows}: {ours:.0f}/{dense:.0f}" for rows, ours, dense in
                          zip(entry["rows"], entry["kernel_us"], entry["dense_us"]))
        lines.append(f"  {key}: ours up to {entry['max_rows']} rows (us ours/dense by rows: "
                     f"{pairs})")
    return "\n".join(lines)
