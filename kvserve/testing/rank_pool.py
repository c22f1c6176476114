"""A pool of tensor-parallel ranks in spawned processes that run functions on request.

Starting a rank costs seconds (torch import, process group), so tests and benchmarks start one
pool and send it many jobs: `pool.run(fn, *args)` calls `fn(contexts, *args)` on every rank at
once and returns the results in rank order. `contexts` maps an all-reduce name ("torch": the
gloo group's, "shm": shared memory) to that rank's ParallelContext over one process group, so
one pool checks both. Children die with the parent (PR_SET_PDEATHSIG) and are joined on close.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import traceback
from typing import Any, Callable

import torch

from kvserve.platform import die_with_parent


class RankError(RuntimeError):
    """A job raised on a rank; the message holds that rank's traceback."""


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RankPool:
    def __init__(self, world_size: int, threads_per_rank: int = 1, timeout_s: float = 120.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        context = multiprocessing.get_context("spawn")
        self._connections = []
        self._processes = []
        for rank in range(world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_serve, args=(rank, world_size, init_method, threads_per_rank, timeout_s,
                                     child_end), daemon=True, name=f"kvserve-tp-rank-{rank}")
            process.start()
            child_end.close()
            self._connections.append(parent_end)
            self._processes.append(process)

    def run(self, fn: Callable[..., Any], *args) -> list[Any]:
        """fn(contexts, *args) on every rank; raises RankError if any rank raised."""
        payload = pickle.dumps((fn, args))
        for connection in self._connections:
            connection.send_bytes(payload)
        results = [self._receive(rank, connection)
                   for rank, connection in enumerate(self._connections)]
        errors = [f"rank {rank}:\n{value}" for rank, (ok, value) in enumerate(results) if not ok]
        if errors:
            raise RankError("\n".join(errors))
        return [value for _, value in results]

    def _receive(self, rank: int, connection) -> tuple[bool, Any]:
        if not connection.poll(self.timeout_s):
            self.close()
            raise TimeoutError(f"rank {rank} gave no answer within {self.timeout_s:.0f} s")
        try:
            return pickle.loads(connection.recv_bytes())
        except EOFError:
            self.close()
            raise RankError(f"rank {rank} died (exit code {self._processes[rank].exitcode})")

    def close(self) -> None:
        """Ask every rank to leave, then join it (killing one that does not leave in time)."""
        for connection in self._connections:
            try:
                connection.send_bytes(pickle.dumps(None))
            except (BrokenPipeError, OSError):
                pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self._connections:
            connection.close()
        self._connections, self._processes = [], []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(rank: int, world_size: int, init_method: str, threads: int, timeout_s: float,
           connection) -> None:
    die_with_parent()
    torch.set_num_threads(threads)
    from kvserve.distributed.parallel_state import (
        build_context,
        destroy_distributed,
        init_distributed,
    )

    os.environ.setdefault("KVSERVE_AUTOTUNE", "0")
    gloo = init_distributed(rank, world_size, init_method, "gloo", "torch", timeout_s=timeout_s)
    contexts = {"torch": gloo, "shm": build_context(rank, world_size, gloo.group, "shm", "gloo")}
    try:
        while True:
            job = pickle.loads(connection.recv_bytes())
            if job is None:
                break
            fn, args = job
            try:
                reply = (True, fn(contexts, *args))
            except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
                reply = (False, traceback.format_exc())
            connection.send_bytes(pickle.dumps(reply))
    finally:
        contexts["shm"].communicator.close()
        destroy_distributed(None)
