"""Custom logits processors (kvserve.testing.logits_processors) in the engine: one changes exactly
the requests that ask for it, under batching, preemption (the processors' rows always match the
runner's persistent batch), a failing apply (only its request fails) and the mp executor; how
they are named, loaded and checked at start-up; their per-request arguments checked in the
front-end."""

from __future__ import annotations

import argparse

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine_config import EngineConfig
from kvserve.entrypoints.cli_args import add_engine_args, engine_config_from_args
from kvserve.errors import InvalidRequestError
from kvserve.testing.logits_processors import BanTokens, FailWhenAsked, RecordRows
from tests.helpers import bounded

GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "Paris is", "1, 2, 3,"]


# ---- a custom processor in the engine -----------------------------------------------------------

@pytest.fixture(scope="module")
def plain_tokens(tiny_llm):
    outputs = tiny_llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def llm_with(tiny_model_dir, processors, **options) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", block_size=16, engine_core="thread",
               logits_processors=processors, **{"num_kv_blocks": 256, **options})


def ban_params(tokens: list[int], **extra) -> SamplingParams:
    return SamplingParams(extra_args={"ban_tokens": tokens[:4], **extra}, **GREEDY)


def test_custom_processor_changes_exactly_the_rows_that_ask(tiny_model_dir, plain_tokens):
    llm = llm_with(tiny_model_dir, [BanTokens])
    asking = {1, 3}
    params = [ban_params(plain_tokens[i]) if i in asking else SamplingParams(**GREEDY)
              for i in range(len(PROMPTS))]
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for i, tokens in enumerate(outputs):
        if i in asking:
            assert not set(tokens) & set(plain_tokens[i][:4])
            alone = llm.generate(PROMPTS[i], params[i], use_tqdm=False)[0]
            assert tokens == alone.outputs[0].token_ids
        else:
            assert tokens == plain_tokens[i]


def test_processor_events_hold_under_preemption(tiny_model_dir, plain_tokens):
    """A pool of 16 blocks for 5 long requests: they are preempted and come back, and the
    processors' rows always match the runner's batch; the tokens match a large pool's."""
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(60 + 20 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, extra_args={
        "tag": f"p{i}", **({"ban_tokens": [5, 6, 7]} if i % 2 else {})}) for i in range(5)]
    processors = [BanTokens, RecordRows]
    large = llm_with(tiny_model_dir, processors)
    expected = [o.outputs[0].token_ids for o in large.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    small = llm_with(tiny_model_dir, processors, num_kv_blocks=16)
    engine = small.llm_engine
    runner = engine.engine_core.runner
    recorder = runner.sampler.processors[-1]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    finished = {}
    for _ in bounded(10_000, "the requests"):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        assert recorder.tags() == [r.sampling_params.extra_args["tag"]
                                   for r in runner.input_batch.requests]
    assert engine.engine_core.scheduler.num_preemptions > 0
    assert [finished[str(i)] for i in range(5)] == expected
    assert recorder.size_mismatches == []


def test_a_failing_apply_fails_only_the_request_that_uses_it(tiny_model_dir, plain_tokens):
    """The batch raises; the engine core re-runs each request alone and fails only the one that
    asked for the failing processor. The processors' rows are right again afterwards."""
    llm = llm_with(tiny_model_dir, [FailWhenAsked, RecordRows])
    engine = llm.llm_engine
    runner = engine.engine_core.runner
    recorder = runner.sampler.processors[-1]
    for i, prompt in enumerate(PROMPTS):
        extra = {"tag": str(i), **({"fail": True} if i == 2 else {})}
        engine.add_request(str(i), prompt, SamplingParams(extra_args=extra, **GREEDY))
    finished, failures = {}, []
    for _ in bounded(10_000, "the requests"):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        failures += engine.take_failures()
        assert recorder.tags() == [r.sampling_params.extra_args["tag"]
                                   for r in runner.input_batch.requests]
    assert [request_id for request_id, _ in failures] == ["2"]
    assert "a request asked this processor to fail" in str(failures[0][1])
    assert finished == {str(i): plain_tokens[i] for i in range(len(PROMPTS)) if i != 2}


def test_mp_workers_load_the_processor_by_name(tiny_model_dir, plain_tokens):
    llm = llm_with(tiny_model_dir, ["kvserve.testing.logits_processors:BanTokens"],
                   distributed_executor_backend="mp")
    try:
        params = [ban_params(plain_tokens[0]), SamplingParams(**GREEDY)]
        outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert not set(outputs[0].outputs[0].token_ids) & set(plain_tokens[0][:4])
        assert outputs[1].outputs[0].token_ids == plain_tokens[1]
    finally:
        llm.shutdown()


# ---- configuration -------------------------------------------------------------------------------

class _Local:  # not a LogitsProcessor
    pass


def test_processors_are_stored_by_name_and_checked_at_start(tiny_model_dir):
    config = EngineConfig(logits_processors=[
        BanTokens, "kvserve.testing.logits_processors.RecordRows"])
    assert config.logits_processors == ("kvserve.testing.logits_processors:BanTokens",
                                        "kvserve.testing.logits_processors:RecordRows")

    class Nested(BanTokens):
        pass

    with pytest.raises(ValueError, match="importable module"):
        EngineConfig(logits_processors=[Nested])
    with pytest.raises(ValueError, match="'module:Class'"):
        EngineConfig(logits_processors=["NoModule"])
    for name, why in [("kvserve.no_such_module:Thing", "cannot be imported"),
                      ("tests.test_logits_processors:_Local", "not a subclass")]:
        with pytest.raises(ValueError, match=why):
            LLM(model=str(tiny_model_dir), logits_processors=[name], engine_core="thread")


def test_the_flag_repeats_and_takes_commas():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--logits-processors", "a.b:C", "--logits-processors",
                              "d:E, f.g.H"])
    assert engine_config_from_args(args).logits_processors == ("a.b:C", "d:E", "f.g:H")
    assert engine_config_from_args(parser.parse_args([])).logits_processors == ()


def test_a_processor_checks_its_arguments_in_the_front_end(tiny_model_dir):
    llm = llm_with(tiny_model_dir, [BanTokens])
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("hi", SamplingParams(extra_args={"ban_tokens": "all"}), use_tqdm=False)
    assert error.value.param == "extra_args" and "ban_tokens" in str(error.value)
    with pytest.raises(InvalidRequestError):
        SamplingParams(extra_args={"x": object()})
