"""Starting and stopping the deployments `kvserve plan` measures here (calibration and
`--validate`): `kvserve serve` processes, Ray Serve launches, a prefill and a decode server
behind the router, each in its own session so a stop takes its children too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from kvserve.bench.plan.predict import Candidate


@dataclass(frozen=True)
class Deployment:
    """A candidate and how to start it here."""
    name: str
    candidate: Candidate
    serve_args: tuple[str, ...]  # `kvserve serve` options beyond --model and --port


def start(model: str, deployment: Deployment, processes: list) -> str:
    """Launch the servers (and router) of one deployment; the URL to load."""
    from kvserve.ports import free_port

    if deployment.candidate.mode != "disaggregated":
        port = free_port()
        processes.append(_spawn(["serve", "--model", model, "--port", str(port),
                                 *deployment.serve_args]))
        return healthy(f"http://127.0.0.1:{port}", processes)
    urls = {}
    for role in ("prefill", "decode"):
        port = free_port()
        transfer = {"kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                    "kv_connector_extra_config": {"transport": "shm"}}  # one host
        processes.append(_spawn(["serve", "--model", model, "--port", str(port),
                                 "--kv-transfer-config", json.dumps(transfer),
                                 *deployment.serve_args]))
        urls[role] = healthy(f"http://127.0.0.1:{port}", processes)
    port = free_port()
    processes.append(_spawn(["router", "--port", str(port), "--prefill", urls["prefill"],
                             "--decode", urls["decode"]]))
    return healthy(f"http://127.0.0.1:{port}", processes)


def _spawn(argv: list[str]) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile(prefix="kvserve-plan-", suffix=".log", delete=False)
    return subprocess.Popen([sys.executable, "-m", "kvserve.cli", *argv], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def healthy(url: str, processes: list, timeout: float = 240.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in processes if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{' '.join(map(str, dead[0].args[2:5]))} exited with "
                               f"{dead[0].returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return url
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy in {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's session (a Ray Serve launch has children), then wait."""
    from kvserve.processes import stop_process

    if process.poll() is None:
        try:
            os.killpg(process.pid, 15)
        except ProcessLookupError:
            pass
    stop_process(process, grace=30.0)
