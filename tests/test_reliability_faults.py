"""Faults: an exception inside one request, and a dead engine thread. The failing request must
get a clean OpenAI-style error, everyone else must be served as if nothing happened (same greedy
tokens), and the engine must end idle. If the engine thread dies, /health goes 503 and waiting
clients get a 503 body or an SSE error event instead of hanging. (Clients that disconnect are in
test_reliability_load.py, which shares its server with the load tests.)

Faults are injected through kvserve.testing.faults, a general plugin: off unless the test turns
it on in its own process (`faults.enable()`) or starts the server with KVSERVE_PLUGINS naming it.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.engine.llm_engine import RequestFailedError
from kvserve.plugins import ENV_VAR as PLUGINS_ENV_VAR
from kvserve.testing import faults
from kvserve.testing.server import ServerProcess
from tests.helpers import (
    bounded,
    assert_health_went_503_then_gone,
    assert_idle,
    complete,
    finished_by_reason,
    tiny_server_flags,
    watch_health,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "Paris is"]


# ---- in the engine -----------------------------------------------------------------------
@pytest.fixture
def faulty_engine(tiny_llm):
    engine = tiny_llm.llm_engine
    faults.enable(True)
    yield engine
    faults.enable(False)
    engine.abort_request(list(engine.groups))


def run_all(engine, requests: dict[str, tuple[str, SamplingParams]]):
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished, failed = {}, {}
    for _ in bounded(10_000, "the requests"):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = [o.token_ids for o in output.outputs]
        failed.update(engine.take_failures())
    return finished, failed


@pytest.mark.parametrize("kind", ["execute", "output"])
def test_fault_in_one_request_fails_only_that_request(faulty_engine, kind):
    clean = {f"clean-{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    expected, _ = run_all(faulty_engine, clean)
    poisoned = {f"bad-{kind}": (f"kvserve-fault:{kind} {PROMPTS[1]}", GREEDY),
                f"bad-n2-{kind}": (f"kvserve-fault:{kind} x", SamplingParams(n=2, max_tokens=4))}
    requests = {f"again-{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    finished, failed = run_all(faulty_engine, {**requests, **poisoned})
    assert set(failed) == set(poisoned)
    assert all(isinstance(e, RequestFailedError) and "InjectedFault" in str(e)
               for e in failed.values())
    assert finished == {f"again-{i}": expected[f"clean-{i}"] for i in range(len(PROMPTS))}
    assert faulty_engine.engine_core.kv_manager.pool.num_used_blocks == 0
    assert not faulty_engine.engine_core.scheduler.has_unfinished()


def test_offline_generate_raises_for_a_failed_request(tiny_llm, faulty_engine):
    with pytest.raises(RequestFailedError):
        tiny_llm.generate(["fine", "kvserve-fault:execute boom"], GREEDY, use_tqdm=False)
    assert not faulty_engine.has_unfinished_requests()
    assert faulty_engine.engine_core.kv_manager.pool.num_used_blocks == 0
    assert tiny_llm.generate(["fine"], GREEDY, use_tqdm=False)[0].finished


def test_fault_hook_is_off_by_default(tiny_llm):
    out = tiny_llm.generate("kvserve-fault:execute kvserve-fault:output", GREEDY,
                            use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


# ---- through the server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def fault_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fault-server") / "server.log"
    flags = tiny_server_flags(tiny_model_dir, max_model_len=2048)
    with ServerProcess(flags, log_path=log, env={PLUGINS_ENV_VAR: faults.PLUGIN}) as process:
        yield process
    # the last test kills the engine: the server then exits non-zero on its own
    assert process.exit_code == 1


def _streamed_text(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]
                   if json.loads(e).get("choices"))


def test_server_fails_only_the_poisoned_requests(fault_server):
    async def scenario():
        async with httpx.AsyncClient(base_url=fault_server.base_url, timeout=60) as client:
            alone = [await complete(client, p) for p in PROMPTS]
            together = await asyncio.gather(
                *(complete(client, p) for p in PROMPTS),
                *(complete(client, p, stream=True) for p in PROMPTS),
                complete(client, "kvserve-fault:execute hello"),
                complete(client, "kvserve-fault:output hello"),
                complete(client, "kvserve-fault:execute hello", stream=True, max_tokens=50))
            return alone, together

    alone, together = asyncio.run(scenario())
    texts = [body["choices"][0]["text"] for _, body in alone]
    plain, streamed, faults = together[:4], together[4:8], together[8:]
    assert [body["choices"][0]["text"] for _, body in plain] == texts
    assert [_streamed_text(events) for _, events in streamed] == texts
    for status, body in faults[:2]:
        assert status == 500
        assert body["error"]["code"] == "engine_error" and "InjectedFault" in \
            body["error"]["message"]
    status, events = faults[2]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    assert_idle(fault_server.base_url)
    assert finished_by_reason(fault_server.base_url)["error"] == 3
    assert httpx.get(fault_server.base_url + "/health").status_code == 200


def test_engine_thread_death_gives_503_not_hangs(fault_server):
    """Kills the module's server engine: keep this the module's last test. The streams get
    their errors, then the server exits 1 so an orchestrator restarts it (the process core's
    restart option is in test_engine_process_faults.py)."""
    async def scenario():
        async with httpx.AsyncClient(base_url=fault_server.base_url, timeout=30) as client:
            waiting = [asyncio.ensure_future(complete(client, "a long one", max_tokens=1900)),
                       asyncio.ensure_future(complete(client, "streamed", stream=True,
                                                       max_tokens=1900))]
            await asyncio.sleep(0.5)
            health = asyncio.ensure_future(watch_health(fault_server.base_url, asyncio.Event()))
            killer = await complete(client, "kvserve-fault:engine_thread")
            answers = await asyncio.gather(*waiting)
            return killer, answers, await asyncio.wait_for(health, 60)

    killer, (plain, streamed), health = asyncio.run(scenario())
    for status, body in (killer, plain):
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
    assert streamed[0] == 200 and streamed[1][-1] == "[DONE]"
    assert json.loads(streamed[1][-2])["error"]["code"] == "engine_unavailable"
    fault_server.process.wait(60)
    assert fault_server.process.returncode == 1
    assert_health_went_503_then_gone(health)  # never a 200 after the thread died
