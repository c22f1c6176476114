"""The engine core in its own process (`engine_core="process"`), offline: the same tokens as the
core on a thread, failures that keep their type, a dead core that fails calls instead of hanging,
and no process left behind."""

from __future__ import annotations

import os
import signal

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import CorruptModelFileError, EngineDeadError
from tests.helpers import bounded, process_alive, step_until_raises, wait_gone

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "Paris is", "1, 2, 3,",
           "import os\n", "Hello", "The capital of"]


@pytest.fixture(scope="module")
def process_llm(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
              engine_core="process")
    yield llm
    llm.shutdown()


def _mixed_params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [greedy,
            SamplingParams(temperature=0, max_tokens=12, stop=[" the", "e"]),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
            SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=9, presence_penalty=0.5,
                           repetition_penalty=1.2, ignore_eos=True),
            greedy, SamplingParams(temperature=0, max_tokens=30, min_tokens=4)]


def _summary(outputs):
    return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason,
              None if o.logprobs is None else [sorted(d) for d in o.logprobs])
             for o in out.outputs] for out in outputs]


def test_process_core_gives_the_thread_cores_outputs(tiny_llm, process_llm):
    params = _mixed_params()
    expected = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    got = process_llm.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    assert all(o.metrics.first_token_time is not None for o in got)
    assert process_llm.llm_engine.core.call_utility("stats").num_used_blocks == 0


def test_stop_strings_are_cut_in_the_front_end_and_the_core_lets_go(process_llm):
    engine = process_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=200, stop=["e"])
    out = process_llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in out)
    assert engine.core.call_utility("num_unfinished") == 0
    assert engine.core.call_utility("stats").num_used_blocks == 0


def test_abort_reaches_the_core(process_llm):
    engine = process_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    engine.add_request("to-abort", "a long story", params)
    for _ in bounded(1000, "the first token"):
        if engine.step():
            break
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    assert engine.core.call_utility("num_unfinished") == 0


def test_startup_failure_keeps_its_type_and_leaves_no_process(tmp_path, tiny_model_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    before = _children()
    with pytest.raises(CorruptModelFileError):
        LLM(model=str(broken), dtype="float32", engine_core="process")
    assert all(wait_gone(pid) for pid in _children() - before)


def test_killed_core_fails_the_caller_and_shutdown_reaps(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
              engine_core="process")
    engine = llm.llm_engine
    pid = engine.core.ready.pid
    assert process_alive(pid)
    engine.add_request("long", "a story", SamplingParams(max_tokens=800, ignore_eos=True))
    engine.step()
    os.kill(pid, signal.SIGKILL)
    step_until_raises(engine, EngineDeadError, within=5, match="SIGKILL")
    llm.shutdown()
    assert wait_gone(pid)
    with pytest.raises(EngineDeadError):
        llm.generate("x", use_tqdm=False)


def test_shutdown_stops_and_reaps_the_core(tiny_model_dir):
    with LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
             engine_core="process") as llm:
        pid = llm.llm_engine.core.ready.pid
        assert llm.generate("hi", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
    assert wait_gone(pid, timeout=10)


def _children() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


TORCH_BLOCKER = '''
import importlib.abc, sys

class _NoTorchInTheFrontEnd(importlib.abc.MetaPathFinder):
    """The API server process (kvserve.cli) may not import torch; its engine core may."""
    def find_spec(self, name, path, target=None):
        if name == "torch" and sys.argv and sys.argv[0].endswith("cli.py"):
            raise ImportError("torch imported by the API front-end")
        return None

sys.meta_path.insert(0, _NoTorchInTheFrontEnd())
'''


def test_the_api_server_process_serves_without_importing_torch(tmp_path, tiny_model_dir):
    """The front-end checks the architecture by name, tokenizes and streams; only the engine
    core imports torch (about 250 MB and 1.5 s of the front-end's start otherwise)."""
    import json
    import urllib.request

    from kvserve.testing.server import ServerProcess

    (tmp_path / "sitecustomize.py").write_text(TORCH_BLOCKER)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    log = tmp_path / "server.log"
    with ServerProcess(["--model", str(tiny_model_dir), "--dtype", "float32",
                        "--num-kv-blocks", "64"], env={"PYTHONPATH": path},
                       log_path=log) as server:
        body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 5, "logprobs": 2,
                           "temperature": 0, "logit_bias": {"5": 1.0}}).encode()
        request = urllib.request.Request(server.base_url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.load(response)
    assert completion["usage"]["completion_tokens"] == 5
    assert "torch imported by the API front-end" not in log.read_text(errors="replace")
