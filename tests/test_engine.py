"""The engine and the offline LLM API on the tiny random model (fast)."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.errors import ContextLengthExceededError, InvalidRequestError
from tests.helpers import bounded, run_mixed_workload, small_pool_options

GREEDY = dict(temperature=0.0)


def test_generate_accepts_strings_token_ids_and_dicts(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    ids = tokenizer.encode("Hello there")
    params = SamplingParams(max_tokens=5, **GREEDY)
    by_text = tiny_llm.generate("Hello there", params, use_tqdm=False)[0]
    by_ids = tiny_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert by_text.prompt_token_ids == ids and by_text.prompt == "Hello there"
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert len(by_text.outputs[0].token_ids) == 5
    assert by_text.outputs[0].finish_reason == "length"
    assert by_text.outputs[0].text == tokenizer.decode(by_text.outputs[0].token_ids)


def test_outputs_come_back_in_prompt_order(tiny_llm):
    prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]
    outputs = tiny_llm.generate(prompts, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts


def test_stop_string_truncates_text(tiny_llm):
    params = SamplingParams(max_tokens=30, **GREEDY)
    free = tiny_llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    stop = free.text[10:13]
    assert len(stop) == 3
    cut = tiny_llm.generate("Once upon a time",
                            SamplingParams(max_tokens=30, stop=[stop], **GREEDY),
                            use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[: free.text.index(stop)]
    kept = tiny_llm.generate("Once upon a time", SamplingParams(
        max_tokens=30, stop=[stop], include_stop_str_in_output=True, **GREEDY),
        use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]


def test_stop_token_ids(tiny_llm):
    free = tiny_llm.generate("abc", SamplingParams(max_tokens=10, **GREEDY),
                             use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[3]
    out = tiny_llm.generate("abc", SamplingParams(max_tokens=10, stop_token_ids=[stop_id],
                                                  **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


def test_bad_requests_raise_and_queue_nothing(tiny_llm):
    engine = tiny_llm.llm_engine
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        tiny_llm.generate({"prompt_token_ids": [10**7]}, use_tqdm=False)
    with pytest.raises(ContextLengthExceededError):
        tiny_llm.generate("hi", SamplingParams(max_tokens=engine.max_model_len),
                          use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        tiny_llm.generate("hi", SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.kv_manager.pool.num_used_blocks == 0


def test_abort_frees_blocks_immediately(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request("to-abort", "some prompt " * 20, SamplingParams(max_tokens=50, n=2))
    engine.step()
    engine.step()
    assert engine.engine_core.kv_manager.pool.num_used_blocks > 0
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.kv_manager.pool.num_used_blocks == 0
    assert engine.step() == []


def test_n_samples_share_the_prompt_blocks(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.engine_core.kv_manager.reset_prefix_cache()
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks + a partial one
    engine.add_request("fan", {"prompt_token_ids": prompt},
                       SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=7))
    hits_before = engine.engine_core.kv_manager.stats.hits
    outputs = []
    for _ in bounded(100, "the fan-out"):
        if not engine.has_unfinished_requests():
            break
        tables = [engine.engine_core.kv_manager.block_ids(f"{i}_fan") for i in range(4)]
        if all(tables):
            shared = {tuple(t[:2]) for t in tables}
            assert len(shared) == 1, "the prompt's full blocks are allocated once"
            assert len({t[2] for t in tables}) == 4, "each sample owns its partial block"
        outputs += engine.step()
    assert engine.engine_core.kv_manager.stats.hits - hits_before == 3 * 32
    final = outputs[-1]
    assert final.finished and len(final.outputs) == 4
    assert [o.index for o in final.outputs] == [0, 1, 2, 3]


def test_same_seed_same_tokens_alone_and_in_batch(tiny_llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    alone = tiny_llm.generate("The weather today", params, use_tqdm=False)[0]
    batch = tiny_llm.generate(
        ["Something else entirely", "The weather today", "A third prompt"],
        [SamplingParams(max_tokens=12, temperature=1.0), params,
         SamplingParams(max_tokens=5, temperature=0.5, seed=9)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_logprobs_and_cached_tokens(tiny_llm):
    prompt = "shared prefix " * 12
    first = tiny_llm.generate(prompt, SamplingParams(max_tokens=3, logprobs=2, **GREEDY),
                              use_tqdm=False)[0]
    second = tiny_llm.generate(prompt, SamplingParams(max_tokens=3, **GREEDY),
                               use_tqdm=False)[0]
    output = first.outputs[0]
    assert len(output.logprobs) == 3
    for token_id, entry in zip(output.token_ids, output.logprobs):
        assert token_id in entry and entry[token_id].rank == 1
        assert len(entry) == 2 and entry[token_id].decoded_token is not None
    assert output.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(output.token_ids, output.logprobs)))
    assert second.num_cached_tokens >= 16
    assert second.metrics.time_to_first_token >= 0


def test_chat_uses_the_template(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                        use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system")
    assert out.prompt_token_ids[0] == 1


def test_unknown_llm_option(tiny_model_dir):
    from kvserve import LLM

    with pytest.raises(TypeError, match="bogus"):
        LLM(model=str(tiny_model_dir), bogus=1)


def test_token_id_prompts_must_be_integers(tiny_llm):
    for bad in ({"prompt_token_ids": ["a", "b"]}, {"prompt_token_ids": [1.5]},
                {"prompt_token_ids": "123"}):
        with pytest.raises(InvalidRequestError, match="integers"):
            tiny_llm.generate(bad, use_tqdm=False)


def test_kv_cache_dtype_choice():
    from kvserve.platform import kv_cache_dtype

    # bf16 K/V only where float32 is the machine's default, not the user's exact reference
    assert kv_cache_dtype("auto", torch.float32, True, "cpu") == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32, False, "cpu") == torch.float32
    assert kv_cache_dtype("auto", torch.bfloat16, True, "cpu") == torch.bfloat16
    assert kv_cache_dtype("float32", torch.float32, True, "cpu") == torch.float32


def test_bf16_kv_cache_with_float32_activations(tiny_model_dir):
    """Half the bytes per block (twice the blocks for the same memory); chunked and whole
    prefills attend over the same stored K/V (identical tokens); close to the float32 cache."""
    from kvserve import LLM

    budget = 4 << 20
    kwargs = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=budget,
                  block_size=16, engine_core="thread")
    whole = LLM(kv_cache_dtype="bfloat16", **kwargs)
    chunked = LLM(kv_cache_dtype="bfloat16", max_num_batched_tokens=16, **kwargs)
    exact = LLM(kv_cache_dtype="float32", **kwargs)
    assert whole.llm_engine.engine_core.runner.kv_caches[0].dtype == torch.bfloat16
    assert (whole.llm_engine.engine_core.runner.kv_caches[0].shape[1]
            == 2 * exact.llm_engine.engine_core.runner.kv_caches[0].shape[1])
    prompts = ["The weather today is " * 6, "def parse(text):\n    return", "Once upon"]
    params = SamplingParams(max_tokens=12, logprobs=1, **GREEDY)
    runs = [llm.generate(prompts, params, use_tqdm=False) for llm in (whole, chunked, exact)]
    for a, b, c in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        first = a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]].logprob
        reference = c.outputs[0].logprobs[0][c.outputs[0].token_ids[0]].logprob
        assert abs(first - reference) < 0.05


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir):
    """The mixed workload the plain way: torch_ref attention and torch ops, the whole prompt in
    one step, no prefix cache, blocks for everyone."""
    from kvserve import LLM

    llm = LLM(model=str(tiny_model_dir), dtype="float32", attention_backend="torch_ref",
              cpu_kernels=False, enable_prefix_caching=False, num_kv_blocks=512,
              engine_core="thread")
    yield run_mixed_workload(llm)
    llm.shutdown()


def test_engine_tokens_equal_the_reference_run_at_every_level(isa_level, tiny_model_dir,
                                                              reference_run):
    """The default fast path (paged attention, this level's C++ kernels) with chunked prefill,
    prefix hits and preemption on a small pool: the reference run's greedy tokens, logprobs
    within 1e-4."""
    from kvserve import LLM

    llm = LLM(model=str(tiny_model_dir), engine_core="thread", **small_pool_options())
    try:
        core = llm.llm_engine.engine_core
        assert core.runner.model.kernel_ops.isa == isa_level
        tokens, logprobs = run_mixed_workload(llm)
        assert core.scheduler.num_preemptions > 0 and core.kv_manager.stats.hits > 0
    finally:
        llm.shutdown()
    expected_tokens, expected_logprobs = reference_run
    assert tokens == expected_tokens
    assert len(logprobs) == len(expected_logprobs) > 0
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-4


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_a_finished_requests_id_can_be_used_again(tiny_model_dir, engine_core):
    """vLLM lets an id come back once its request finished. The old one's cleanup and the new
    one reach the workers in the same step: the core's step encoder and the worker forget the
    old one first (the worker raised KeyError and the engine died)."""
    from kvserve import LLM

    llm = LLM(model=str(tiny_model_dir), engine_core=engine_core, dtype="float32")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    answers = []
    try:
        for _ in range(3):
            engine.add_request("again", {"prompt_token_ids": [5, 6, 7]}, params)
            while engine.has_unfinished_requests():
                answers += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    finally:
        engine.shutdown()
    assert len(answers) == 3 and answers[0] == answers[1] == answers[2]


def _run_kinds(engine, prompt: str, params: SamplingParams) -> dict:
    """The same request under each output kind, all in one batch: every output it produced."""
    from kvserve.sampling_params import RequestOutputKind

    outputs: dict = {}
    for kind in RequestOutputKind:
        kind_params = params.clone()
        kind_params.output_kind = kind
        engine.add_request(kind.name, prompt, kind_params)
        outputs[kind.name] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


@pytest.mark.parametrize("stop", [False, True])
def test_delta_outputs_add_up_to_the_cumulative_one_and_final_only_comes_once(tiny_llm, stop):
    """DELTA outputs carry each token, logprob and character once (the stop-string holdback
    too); FINAL_ONLY builds one output, equal to CUMULATIVE's last."""
    engine = tiny_llm.llm_engine
    prompt = "Once upon a time"
    params = SamplingParams(max_tokens=24, logprobs=2, n=2, seed=3, temperature=0.9)
    if stop:
        free = _run_kinds(engine, prompt, params)["CUMULATIVE"][-1].outputs[0].text
        params.stop = [free[8:11]]
    outputs = _run_kinds(engine, prompt, params)
    final = outputs["CUMULATIVE"][-1]
    assert final.finished and len(outputs["CUMULATIVE"]) > 3
    if stop:
        assert final.outputs[0].finish_reason == "stop"
    assert len(outputs["FINAL_ONLY"]) == 1 and outputs["FINAL_ONLY"][0].finished
    assert [o.text for o in outputs["FINAL_ONLY"][0].outputs] == [o.text for o in final.outputs]
    deltas = outputs["DELTA"]
    for index, whole in enumerate(final.outputs):
        pieces = [sample for output in deltas for sample in output.outputs
                  if sample.index == index]
        assert "".join(p.text for p in pieces) == whole.text
        assert [t for p in pieces for t in p.token_ids] == whole.token_ids
        entries = [e for p in pieces for e in p.logprobs]  # other rows of one batch: ~equal
        assert [sorted(e) for e in entries] == [sorted(e) for e in whole.logprobs]
        assert [v.logprob for e in entries for v in e.values()] == pytest.approx(
            [v.logprob for e in whole.logprobs for v in e.values()], abs=1e-4)
        assert pieces[-1].finish_reason == whole.finish_reason
        assert pieces[-1].cumulative_logprob == pytest.approx(whole.cumulative_logprob)
    assert max(len(s.token_ids) for o in deltas for s in o.outputs) == 1  # one token a step
