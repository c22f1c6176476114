"""The `mp` executor: worker processes holding tensor-parallel shards and pipeline stages,
driven by the engine core. Greedy tokens equal the single-process engine's, and the sampled
tokens' logprobs agree within 1e-4, on a mixed ragged workload of 16 prompts (chunked prefill,
prefix hits, preemption, n > 1, stop strings); with pipeline stages batches really overlap; a
killed worker fails the engine instead of hanging it, and every process is reaped."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import EngineDeadError
from kvserve.testing.tiny import write_tiny_model_dir
from tests.helpers import (
    bounded,
    small_pool_options,
    process_alive,
    run_mixed_workload,
    step_until_raises,
    wait_gone,
)

pytestmark = pytest.mark.multiprocess

@pytest.fixture(scope="module")
def six_head_model_dir(tmp_path_factory, tokenizer):
    """6 query heads and 3 KV heads: tensor parallel 3 splits both."""
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-h6"), tokenizer,
                                num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                                hidden_size=96, intermediate_size=192)


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory, tokenizer):
    """6 layers for pipeline stages (the last stage also runs the LM head, so it gets fewer),
    and an LM head of its own (untied: only the last stage holds it)."""
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-deep"), tokenizer,
                                num_hidden_layers=6, tie_word_embeddings=False)


@pytest.mark.parametrize("tp, pp, engine_core, model", [
    (1, 1, "thread", "six_head"), (2, 1, "thread", "tiny"), (3, 1, "process", "six_head"),
    (1, 2, "thread", "tiny"), (1, 3, "process", "deep"), (2, 2, "thread", "deep")])
def test_mp_workers_match_one_process(request, mixed_workload_reference, tp, pp, engine_core,
                                      model):
    model_dir = request.getfixturevalue(f"{model}_model_dir")
    expected, expected_logprobs, preemptions = mixed_workload_reference(model_dir)
    assert preemptions > 0  # the workload does exercise preemption
    llm = LLM(model=str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              engine_core=engine_core, distributed_executor_backend="mp", **small_pool_options())
    try:
        tokens, logprobs = run_mixed_workload(llm)
        assert tokens == expected
        assert len(logprobs) == len(expected_logprobs) > 0
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-4
    finally:
        llm.shutdown()


def test_pipeline_keeps_one_batch_per_stage_in_flight(tiny_model_dir, mixed_workload_reference):
    """The core submits a second batch (other requests) before collecting the first, and the
    tokens still equal the single-process run's."""
    expected = mixed_workload_reference(tiny_model_dir)[0]
    llm = LLM(model=str(tiny_model_dir), pipeline_parallel_size=2, engine_core="thread",
              **small_pool_options())
    core = llm.llm_engine.engine_core
    depths, submit = [], core.executor.submit

    def recording_submit(step):
        if step.scheduled:
            ids = {item.request_id for item in step.scheduled}
            in_flight = {item.request.request_id for batch in core._batch_queue
                         for item in batch.scheduled}
            assert not ids & in_flight  # batches in flight share no request
            depths.append(len(core._batch_queue))
        submit(step)

    core.executor.submit = recording_submit
    try:
        assert run_mixed_workload(llm)[0] == expected
        assert max(depths) == 1  # a batch went out while another was in flight
        assert depths.count(1) > len(depths) / 4
    finally:
        llm.shutdown()


def test_more_stages_than_layers_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="2 layers cannot make 3 pipeline stages"):
        LLM(model=str(tiny_model_dir), pipeline_parallel_size=3, **small_pool_options())


def test_heads_that_do_not_divide_are_a_clear_error(six_head_model_dir):
    with pytest.raises(ValueError, match="6"):
        LLM(model=str(six_head_model_dir), tensor_parallel_size=4, **small_pool_options())


def test_killed_worker_fails_the_engine_and_nothing_is_left(six_head_model_dir):
    llm = LLM(model=str(six_head_model_dir), tensor_parallel_size=3, engine_core="process",
              **small_pool_options())
    core = psutil.Process(llm.llm_engine.core.ready.pid)
    workers = core.children()
    assert len(workers) == 3
    engine = llm.llm_engine
    engine.add_request("long", "a story", SamplingParams(max_tokens=300, ignore_eos=True))
    engine.step()
    os.kill(workers[1].pid, signal.SIGKILL)
    step_until_raises(engine, EngineDeadError, within=20)
    llm.shutdown()
    assert wait_gone(core.pid)
    assert all(wait_gone(worker.pid) for worker in workers)
    assert not any(process_alive(worker.pid) for worker in workers)


def test_a_step_with_nothing_scheduled_leaves_no_stale_reply(tiny_model_dir):
    """The core skips waiting for an empty step's reply, so rank 0 must send none: a stale reply
    would be read as the next step's tokens."""
    from kvserve.core.engine_core import EngineCore
    from kvserve.engine_config import EngineConfig
    from kvserve.protocol.engine_core import EngineCoreRequest
    from kvserve.protocol.worker import ExecuteStep

    def run(core) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", [5, 6, 7, 8, 9], params, 6))
        tokens = []
        for _ in bounded(1000, "the request"):
            if not core.has_unfinished():
                break
            core.executor.execute(ExecuteStep([], [], []))  # nothing scheduled, between real steps
            tokens += [t for out in core.step().outputs for t in out.new_token_ids]
        return tokens

    options = dict(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32)
    expected = run(EngineCore(EngineConfig(**options)))
    core = EngineCore(EngineConfig(distributed_executor_backend="mp", **options))
    try:
        assert run(core) == expected
    finally:
        core.shutdown()
