"""Facts about the machine that change defaults: bf16 support, thread counts."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from kvserve.kernels import isa
from kvserve.kernels.reference import KV_ROW_DTYPES


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX, and KVSERVE_CPU_ISA not capping below it: oneDNN runs bf16 GEMMs
    natively (twice fp32's rate on Zen 4/5); elsewhere torch emulates them, far slower than fp32,
    so the default activations are float32 there (an `avx2` cap stands in for such a CPU)."""
    return isa.has_native_bf16() and isa.selected_level() == "avx512_bf16"


def default_dtype(device: str) -> torch.dtype:
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, **KV_ROW_DTYPES}


def kv_cache_dtype(choice: str, activations: torch.dtype, dtype_is_default: bool,
                   device: str) -> torch.dtype:
    """`auto`: bf16 K/V beside float32 activations when float32 is only the machine's default
    (CPUs without native bf16: half the KV bytes and twice the tokens; bf16 -> float is a shift),
    else the activations' dtype, so an explicit `--dtype float32` stays the exact reference.
    int8 and fp8 (= fp8_e4m3): quantized rows (kernels/reference.py)."""
    if choice != "auto":
        if choice not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {choice!r}; choose one of auto, "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        return KV_CACHE_DTYPES[choice]
    if activations == torch.float32 and dtype_is_default and not device.startswith("cuda"):
        return torch.bfloat16
    return activations


def die_with_parent() -> None:
    """For `subprocess.Popen(preexec_fn=...)`: on Linux the child gets SIGKILL when the process
    that started it dies, however it dies (kill -9 included), so no child outlives its parent.
    Elsewhere a no-op (the parent's own shutdown path must stop its children)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def exit_when_parent_dies(parent_pid: int, poll_seconds: float = 0.5) -> None:
    """For a child process: exit at once when `parent_pid` is no longer our parent (it died,
    however it died, and we were re-parented). A daemon thread checks getppid() every
    `poll_seconds`. Unlike PR_SET_PDEATHSIG it is not tied to the parent *thread* that started
    us (a front-end may start the engine core from a thread that ends), and it works off
    Linux too."""
    import threading

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(poll_seconds)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op (OpenMP) threads for the engine; None keeps torch's default (one per
    core). The C++ kernels and torch's GEMMs share this pool; the server's event loop runs while
    kernels release the GIL."""
    if num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


# Treat every process as on a host of its own: no /dev/shm all-reduce, no /dev/shm KV transfer
# (what ranks or engines on separate machines must use, exercised on one machine)
CROSS_HOST_ENV = "KVSERVE_CROSS_HOST"
# Set in a Ray worker actor (executor/ray_executor.py): its Ray node's id and IP address
NODE_ID_ENV = "KVSERVE_NODE_ID"
NODE_IP_ENV = "KVSERVE_NODE_IP"


def host_identity() -> str:
    """This machine: host name and kernel boot id (containers may share a host name; two
    processes share /dev/shm and loopback only when both match), plus the Ray node in a Ray
    actor: two Ray nodes are two machines even when a test starts both on one (Ray's node id
    decides, as it decides placement). KVSERVE_CROSS_HOST=1 adds the process id, so that no
    two processes count as one host."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot_id = handle.read().strip()
    except OSError:
        boot_id = ""
    identity = f"{socket.gethostname()}/{boot_id}"
    if os.environ.get(NODE_ID_ENV):
        identity += f"/ray-node:{os.environ[NODE_ID_ENV]}"
    if os.environ.get(CROSS_HOST_ENV, "").lower() in ("1", "true", "yes"):
        identity += f"/pid:{os.getpid()}"
    return identity


def node_address() -> str:
    """An address other machines reach this one at: the Ray node's IP in a Ray actor, else the
    address of the interface that routes outwards (no packet is sent), else the host name's."""
    import socket

    if os.environ.get(NODE_IP_ENV):
        return os.environ[NODE_IP_ENV]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
