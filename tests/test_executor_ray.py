"""The `ray` executor: the mp workers as Ray actors, on one node here (several nodes are not
tested). Greedy tokens equal the single-process engine's on test_executor_mp's workload (chunked
prefill, prefix hits, preemption, n > 1, stop strings) with tensor and pipeline parallelism; a
worker actor killed with -9 fails the executor or the engine core instead of hanging it; nothing
is left behind: no actor, no placement group, and no Ray process when the executor started Ray.

Ray starts once for the module (`ray_cluster`), before the tests with a thread core; their
executors find it running and leave it up. The process-core tests run first, on a Ray
instance their engine core starts (and must stop)."""

from __future__ import annotations

import logging
import os
import signal
import time

import psutil
import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import EngineDeadError
from kvserve.executor.mp import WorkerDiedError
from tests.helpers import (
    small_pool_options,
    process_alive,
    run_mixed_workload,
    step_until_raises,
    wait_gone,
)

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reference(tiny_model_dir, mixed_workload_reference):
    """The single-process engine's tokens and logprobs on the workload."""
    tokens, logprobs, preemptions = mixed_workload_reference(tiny_model_dir)
    assert preemptions > 0  # the workload does exercise preemption
    return tokens, logprobs


def _assert_matches(llm: LLM, reference) -> None:
    tokens, logprobs = run_mixed_workload(llm)
    expected_tokens, expected_logprobs = reference
    assert tokens == expected_tokens
    assert len(logprobs) == len(expected_logprobs) > 0
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-4


def _ray_llm(model_dir, engine_core: str, **extra) -> LLM:
    return LLM(model=str(model_dir), engine_core=engine_core,
               distributed_executor_backend="ray", **small_pool_options(**extra))


def _all_gone(pids) -> bool:
    return all(wait_gone(pid, timeout=15) for pid in pids)


def _ray_processes() -> set[int]:
    """Every process on this machine that looks like Ray's (its services, its workers)."""
    markers = ("ray::", "/ray/core/src/", "/ray/dashboard/", "/ray/_private/", "/ray/autoscaler/")
    found = set()
    for process in psutil.process_iter():
        try:
            command = " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(marker in command for marker in markers):
            found.add(process.pid)
    return found


def _kill_mid_request(llm: LLM, pid: int, error: type[BaseException]):
    """Kill a worker with -9 while a request runs: stepping the engine raises `error` within
    seconds rather than hanging."""
    engine = llm.llm_engine
    engine.add_request("long", "a story", SamplingParams(max_tokens=300, ignore_eos=True))
    engine.step()
    os.kill(pid, signal.SIGKILL)
    return step_until_raises(engine, error, within=20)


# ---- an engine core process that starts its own Ray ------------------------------------------
@pytest.fixture
def own_ray(monkeypatch):
    """No Ray in this process and no cluster address: the engine core starts a local Ray, and
    every Ray process that appears meanwhile must be gone at the end."""
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = _ray_processes()
    yield
    assert _all_gone(_ray_processes() - before)


def _core_tree(llm: LLM) -> tuple[psutil.Process, list[psutil.Process], list[psutil.Process]]:
    """The core process, everything under it (Ray's processes included), and the worker
    actors among them."""
    core = psutil.Process(llm.llm_engine.core.ready.pid)
    tree = core.children(recursive=True)
    actors = [p for p in tree if "RayWorker" in " ".join(p.cmdline())]
    return core, tree, actors


def test_process_core_with_its_own_ray_matches_and_stops_it(own_ray, tiny_model_dir,
                                                            reference):
    llm = _ray_llm(tiny_model_dir, "process", tensor_parallel_size=2)
    core, tree, actors = _core_tree(llm)
    assert len(actors) == 2 and any("raylet" in p.name() for p in tree)
    try:
        _assert_matches(llm, reference)
    finally:
        llm.shutdown()
    assert wait_gone(core.pid)
    assert _all_gone([p.pid for p in tree])


def test_killed_actor_fails_the_process_core_and_nothing_is_left(own_ray, tiny_model_dir):
    llm = _ray_llm(tiny_model_dir, "process", tensor_parallel_size=2)
    core, tree, actors = _core_tree(llm)
    _kill_mid_request(llm, actors[-1].pid, EngineDeadError)
    llm.shutdown()
    assert wait_gone(core.pid)
    assert _all_gone([p.pid for p in tree])
    assert not any(process_alive(p.pid) for p in tree)


# ---- thread cores on the module's Ray ----------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR)
    try:
        yield
    finally:
        ray.shutdown()


def _assert_released(executor) -> None:
    """The executor's actors are gone and its placement group freed; the module's Ray is up."""
    assert _all_gone(executor.worker_pids)
    assert ray.is_initialized()
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_ray_actors_match_one_process(ray_cluster, tiny_model_dir, reference, tp, pp):
    llm = _ray_llm(tiny_model_dir, "thread", tensor_parallel_size=tp,
                   pipeline_parallel_size=pp)
    core = llm.llm_engine.engine_core
    executor = core.executor
    assert len(executor.worker_pids) == tp * pp
    batches_out = []  # batches in flight when each step is submitted
    submit = executor.submit
    executor.submit = lambda step: (batches_out.append(len(core._batch_queue)), submit(step))
    try:
        _assert_matches(llm, reference)
    finally:
        llm.shutdown()
    assert max(batches_out) == pp - 1  # with stages, steps overlap on the actors
    _assert_released(executor)


def test_killed_actor_raises_worker_died(ray_cluster, tiny_model_dir):
    llm = _ray_llm(tiny_model_dir, "thread", tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.executor
    # not the output rank: rank 0 waits for it in a collective
    failure = _kill_mid_request(llm, executor.worker_pids[1], WorkerDiedError)
    assert "died" in str(failure.value)
    with pytest.raises(WorkerDiedError):  # and stays failed
        executor.check_health()
    llm.shutdown()
    _assert_released(executor)


@pytest.mark.slow
def test_ray_actors_run_expert_parallel_with_eplb(ray_cluster, tmp_path, tokenizer,
                                                  mixed_workload_reference):
    """DeepSeek-V3 over two Ray actors with its experts split whole between them and EPLB
    re-placing two redundant copies every 4 steps (point to point between the actors): one
    process's tokens and logprobs (the mp executor's test: tests/test_expert_parallel.py)."""
    from tests.helpers import deepseek_ep_config, save_hf_checkpoint

    save_hf_checkpoint(deepseek_ep_config(2, 49152), tmp_path, tokenizer)
    reference = mixed_workload_reference(tmp_path)[:2]
    llm = _ray_llm(tmp_path, "thread", tensor_parallel_size=2, enable_expert_parallel=True,
                   enable_eplb=True,
                   eplb_config={"step_interval": 4, "num_redundant_experts": 2})
    executor = llm.llm_engine.engine_core.executor
    try:
        _assert_matches(llm, reference)
    finally:
        llm.shutdown()
    _assert_released(executor)
