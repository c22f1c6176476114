"""One end-to-end run with the production defaults that the rest of the suite turns off
(tests/conftest.py): the kernel autotuner (KVSERVE_AUTOTUNE) and the thread governor
(KVSERVE_ADAPTIVE_THREADS) on, as `kvserve serve` runs for users. The tiny model is served in
int4, so the autotuner has layers to time (the first start on a machine serves with the fixed
limits and measures them in the background once idle; later ones read its table), and its greedy
text, before and after the measured limits arrive, must equal the same server's with both off;
streaming, /health and /metrics work."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from kvserve.paths import cache_dir
from kvserve.testing.server import ServerProcess
from tests.helpers import read_metrics, tiny_server_flags

pytestmark = pytest.mark.multiprocess

PROMPTS = ["The quick brown fox", "Once upon a time, in a small village by the river,",
           "def fibonacci(n):\n    ", "Paris is " * 12]
MAX_TOKENS = 16
OFF = {"KVSERVE_AUTOTUNE": "0", "KVSERVE_ADAPTIVE_THREADS": "0"}
ON = {"KVSERVE_AUTOTUNE": "1", "KVSERVE_ADAPTIVE_THREADS": "1"}  # what unset means


def _body(prompt: str, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _greedy_texts(base_url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        response = httpx.post(base_url + "/v1/completions", json=_body(prompt), timeout=120)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def _streamed_text(base_url: str, prompt: str) -> str:
    with httpx.stream("POST", base_url + "/v1/completions", json=_body(prompt, stream=True),
                      timeout=120) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]
                   if json.loads(d)["choices"])


TINY_QKV = "int4:128x64:float32:"  # the tiny model's fused QKV projection, as the tuner keys it


def _table_holds_tiny_shapes() -> bool:
    """An earlier start on this machine measured the tiny model's shapes (its table, in the
    cache directory, holds them: then the server reads them at once)."""
    tables = (cache_dir() / "autotune").glob("kernels-*.json")
    return any(name.startswith(TINY_QKV) for table in tables
               for name in json.loads(table.read_text()))


def _wait_for_background_tuning(log, seconds=300.0) -> None:
    """The server idle until its tuner has measured the tiny QKV shape (it logs each shape)."""
    deadline = time.monotonic() + seconds
    measured = re.compile(rf"autotune {TINY_QKV}\S*: our kernel up to")
    while not measured.search(log.read_text()):
        assert time.monotonic() < deadline, "the background autotuner measured nothing"
        time.sleep(1)


# two server start-ups; the background tuner measures while the second idles (on a busy 2-core
# machine it waits for the cores)
@pytest.mark.timeout(1200)
def test_autotune_and_adaptive_threads_on_give_the_same_answers(tiny_model_dir, tmp_path):
    flags = tiny_server_flags(tiny_model_dir, "--quantization", "int4")
    with ServerProcess(flags, env=OFF, log_path=tmp_path / "off.log") as server:
        expected = _greedy_texts(server.base_url)
    log = tmp_path / "on.log"
    measured_before = _table_holds_tiny_shapes()
    with ServerProcess(flags, env=ON, log_path=log, startup_timeout=900) as server:
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        assert _greedy_texts(server.base_url) == expected
        rounds = 1
        if not measured_before:  # the measured limits reach the layers at the next step
            _wait_for_background_tuning(log)
            assert _greedy_texts(server.base_url) == expected
            rounds = 2
        assert _streamed_text(server.base_url, PROMPTS[1]) == expected[1]
        metrics = read_metrics(server.base_url)
        requests = rounds * len(PROMPTS) + 1
        assert metrics["kvserve:generation_tokens_total"] == requests * MAX_TOKENS
        assert metrics["kvserve:request_success_total"] == requests
    assert server.exit_code == 0
    assert _table_holds_tiny_shapes()
    assert all(expected)
