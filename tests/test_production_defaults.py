"""One end-to-end run with the production defaults that the rest of the suite turns off
(tests/conftest.py): the kernel autotuner (KVSERVE_AUTOTUNE) and the thread governor
(KVSERVE_ADAPTIVE_THREADS) on, as `kvserve serve` runs for users. The tiny model is served in
int4, so the autotuner has layers to time (the first start on a machine measures them, later
ones read its table), and its greedy text must equal the same server's with both off;
streaming, /health and /metrics work."""

from __future__ import annotations

import json

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


def _tuned_tiny_shapes(log_text: str) -> bool:
    """The autotuner timed the tiny model's fused QKV projection in this start-up (it logs each
    shape it measures), or an earlier start on this machine did (its table, in the cache
    directory, holds the shape: then the server read it)."""
    key = "int4:128x64:float32:"
    if f"autotune {key}" in log_text:
        return True
    tables = (cache_dir() / "autotune").glob("kernels-*.json")
    return any(name.startswith(key) for table in tables for name in json.loads(table.read_text()))


# two server start-ups; the first start on a machine also times every int4 layer shape, minutes
# on a busy 2-core machine (later starts read the table)
@pytest.mark.timeout(1200)
def test_autotune_and_adaptive_threads_on_give_the_same_answers(tiny_model_dir, tmp_path):
    flags = tiny_server_flags(tiny_model_dir, "--quantization", "int4")
    with ServerProcess(flags, env=OFF, log_path=tmp_path / "off.log") as server:
        expected = _greedy_texts(server.base_url)
    log = tmp_path / "on.log"
    with ServerProcess(flags, env=ON, log_path=log, startup_timeout=900) as server:
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        assert _greedy_texts(server.base_url) == expected
        assert _streamed_text(server.base_url, PROMPTS[1]) == expected[1]
        metrics = read_metrics(server.base_url)
        assert metrics["kvserve:generation_tokens_total"] == (len(PROMPTS) + 1) * MAX_TOKENS
        assert metrics["kvserve:request_success_total"] == len(PROMPTS) + 1
    assert server.exit_code == 0
    assert _tuned_tiny_shapes(log.read_text())
    assert all(expected)
