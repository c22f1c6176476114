"""Start a real `kvserve serve` (or `kvserve router`) subprocess on a free loopback port, for
end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvserve.platform import die_with_parent
from kvserve.ports import free_port


def kv_events_config() -> str:
    """--kv-events-config publishing (and replaying) on free loopback ports."""
    import json

    return json.dumps({"enable_kv_cache_events": True,
                       "endpoint": f"tcp://127.0.0.1:{free_port()}",
                       "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})


class ServerProcess:
    """`with ServerProcess([...flags]) as server:` -> server.base_url; SIGTERM on exit."""

    def __init__(self, args: list[str], startup_timeout: float = 180.0,
                 log_path: Path | None = None, env: dict[str, str] | None = None,
                 subcommand: str = "serve"):
        self.subcommand = subcommand
        self.port = free_port()
        self.args = args
        self.env = env or {}
        self.startup_timeout = startup_timeout
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.exit_code: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerProcess":
        self.start()
        self._wait_healthy()
        return self

    def start(self) -> None:
        """Launch without waiting for /health (start several, then enter each). From the
        thread that will outlive the server: the child dies with the thread that forked it."""
        if self.process is not None:
            return
        command = [sys.executable, "-m", "kvserve.cli", self.subcommand, "--port", str(self.port),
                   *self.args]
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        # a test run killed mid-way (SIGTERM skips fixture finalizers) takes its servers along
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                                        preexec_fn=die_with_parent)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early with {self.process.returncode}"
                                   + self._log_tail())
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server did not become healthy in {self.startup_timeout:.0f} s"
                           + self._log_tail())

    def _log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log, for the error that says it did not start."""
        if self.log_path is None or not Path(self.log_path).is_file():
            return ""
        return "; its log ends:\n" + Path(self.log_path).read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.exit_code = self.process.returncode if self.process else None
        return self.exit_code

    def __exit__(self, *exc) -> None:
        self.stop()
