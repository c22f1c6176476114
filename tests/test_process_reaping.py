"""Children started with `platform.die_with_parent` do not outlive a parent killed with -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import process_alive, wait_gone

PARENT = """
import subprocess, sys, time
from kvserve.platform import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_dies_with_a_parent_killed_by_sigkill():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert process_alive(child_pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert wait_gone(child_pid, timeout=10)
