"""Speculative decoding: the config as vLLM spells it, prompt-lookup drafts, the step-cost model
that decides how many drafts pay, exact verification in the sampler (greedy: the argmax;
random: rejection sampling that keeps the target distribution; every sampling option over the
accepted prefix), and through the engine the same greedy tokens as without drafts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvserve.sample.sampler import Sampler, SamplingRow
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import parse_speculative_config, speculative_config_text
from kvserve.spec_decode.cost import StepCostModel, allocate_drafts
from kvserve.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


# ---- config -------------------------------------------------------------------------------
def test_config_keys_as_vllm_spells_them():
    config = parse_speculative_config(json.dumps({"method": "ngram",
                                                  "num_speculative_tokens": 3}))
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert json.loads(speculative_config_text(NGRAM)) == NGRAM
    assert parse_speculative_config(None) is None
    with pytest.raises(ValueError, match="unsupported keys \\['draft_tensor_parallel_size'\\]"):
        parse_speculative_config({**NGRAM, "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="method 'eagle' is not built"):
        parse_speculative_config({"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_speculative_config("{method: ngram}")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        parse_speculative_config({**NGRAM, "prompt_lookup_min": 5})


# ---- prompt lookup ------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_latest_match():
    proposer = NgramProposer(2, 4, 3)
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert proposer.propose("a", tokens) == [4, 5, 9]
    assert proposer.propose("a", tokens + [4]) == [5, 9, 9]  # indexed incrementally
    # [7, 8] occurs twice; the longer match (6, 7, 8) wins over the more recent one
    assert proposer.propose("b", [6, 7, 8, 1, 0, 7, 8, 2, 6, 7, 8]) == [1, 0, 7]
    assert proposer.propose("c", [5, 6, 7, 8]) == []
    proposer.finish("a")
    assert "a" not in proposer._indexes


def test_suffix_drafts_follow_the_longest_match_and_its_agreeing_continuations():
    from kvserve.spec_decode.suffix import SuffixProposer

    proposer = SuffixProposer(8)
    # "1 2" follows "7" twice and "8" once; the longest match (2 7 1 2 -> 8) decides, and the
    # draft is as long as the match
    assert proposer.propose("c", [5, 1, 2, 7, 1, 2, 8, 1, 2, 7, 1, 2], 0) == [8, 1, 2, 7, 1]
    # finished outputs are matched by later requests (the prompt is not kept)
    proposer.propose("a", [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2], 3)
    proposer.finish("a")
    assert proposer.propose("b", [9, 9, 1, 2], 2) == [3, 4]
    # two equally long matches that continue differently: the draft's estimated chance is
    # 0.5 from its first token on, so it stops at the match length with min_token_prob 0.5
    # and is empty with 0.7
    tokens = [0, 5, 1, 2, 3, 0, 5, 1, 2, 4, 0, 5, 1, 2]
    assert SuffixProposer(8, min_token_prob=0.5).propose("d", tokens, 0) == [3, 0, 5, 1]
    assert SuffixProposer(8, min_token_prob=0.7).propose("d", tokens, 0) == []


def test_suffix_store_forgets_the_oldest_outputs_and_looks_up_one_bigram():
    """Past max_cached_requests the oldest output leaves the store and drafts no more; a
    proposal reads one bigram's entry of the store's index, not every cached output."""
    from kvserve.spec_decode.suffix import SuffixProposer

    proposer = SuffixProposer(4, max_cached_requests=2)
    for index, output in enumerate(([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15])):
        proposer.propose(str(index), [0, *output], 1)
        proposer.finish(str(index))
    assert proposer.propose("x", [99, 1, 2], 1) == []  # the first output was evicted
    assert proposer.propose("y", [99, 6, 7], 1) == [8, 9]
    assert proposer.propose("z", [99, 11, 12], 1) == [13, 14]
    assert (1, 2) not in proposer._recent and (6, 7) in proposer._recent

    class Untouchable(dict):
        def get(self, *args):
            raise AssertionError("a proposal asked a cached output")

    for cached in proposer._cache.values():
        cached.after = Untouchable(cached.after)
    assert proposer.propose("w", [99, 11, 12], 1) == [13, 14]


def test_suffix_config_defaults_as_vllm():
    config = parse_speculative_config({"method": "suffix"})
    assert config.num_speculative_tokens == config.suffix_decoding_max_tree_depth == 24
    assert config.suffix_decoding_min_token_prob == 0.1


# ---- how many drafts pay ------------------------------------------------------------------
def test_drafts_are_added_only_while_tokens_per_second_rise():
    flat = StepCostModel({1: 0.010, 8: 0.011, 64: 0.020})  # verifying is nearly free
    steep = StepCostModel({1: 0.010, 2: 0.020, 64: 0.640})  # every token costs a step
    gains = {"a": [0.9, 0.81, 0.73, 0.66], "b": [0.2, 0.04, 0.008, 0.0016]}
    # a draft costs 1.4% of a step here: b's second (expected 0.04 tokens) does not pay
    assert allocate_drafts(2, gains, flat) == {"a": 4, "b": 1}
    assert allocate_drafts(2, gains, steep) == {"a": 0, "b": 0}
    medium = StepCostModel({1: 0.010, 64: 0.073})  # each token adds 10% of a 1-token step
    counts = allocate_drafts(2, gains, medium)
    assert counts["a"] >= 2 and counts["b"] <= 1


def test_drafts_that_pay_together_are_allocated_where_one_alone_does_not():
    """A step-cost curve with a jump at 2 tokens (AVX2's profile on Zen 4: 1.56x a 1-token
    step, then ~0.2x a token): one draft at 50% does not pay, four do. Stopping at the first
    draft that did not pay left single streams without drafts for good."""
    from kvserve.spec_decode.cost import a_draft_can_pay

    jump = StepCostModel({1: 0.010, 2: 0.0156, 5: 0.0180, 9: 0.026})
    gains = {"one": [0.5, 0.45, 0.4, 0.36, 0.32, 0.29]}  # 50% first, then 90% a draft
    counts = allocate_drafts(1, gains, jump)
    assert counts["one"] >= 4
    expected = 1 + sum(gains["one"][:counts["one"]])
    assert expected / jump.cost(1 + counts["one"]) > 1.02 / jump.cost(1)
    assert allocate_drafts(1, {"one": [0.5]}, jump) == {"one": 0}  # alone it does not pay
    assert a_draft_can_pay(1, 1, jump)


def test_a_request_whose_misses_stopped_its_drafts_tries_again():
    """Misses lower a request's acceptance estimate until no draft pays; steps without drafts
    move it back toward the prior, so a request that starts copying later gets drafts again
    (before, its estimate stayed where the misses left it for good)."""
    from dataclasses import dataclass, field
    from types import SimpleNamespace

    from kvserve.spec_decode.config import SpeculativeConfig
    from kvserve.spec_decode.drafter import Drafter

    @dataclass(eq=False)  # hashed by identity, as the scheduler's requests
    class Running:
        request_id: str = "r"
        all_token_ids: list = field(default_factory=lambda: list(range(20)))
        num_prompt_tokens: int = 10
        output_token_ids: list = field(default_factory=lambda: list(range(10)))
        sampling_params: object = field(
            default_factory=lambda: SimpleNamespace(structured_outputs=None))
        max_tokens: int = 100
        num_output_tokens: int = 10
        num_tokens: int = 20
        spec_token_ids: list = field(default_factory=list)

    cost = StepCostModel({1: 0.010, 2: 0.0105, 8: 0.014})
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=4), cost)
    request = Running()
    repeat = {"r": request.all_token_ids[-4:]}  # the worker proposes the last 4 tokens again
    drafted = []
    for _ in range(64):
        assert drafter.limits([request], 1) == {"r": 4}  # a single stream: always asked
        drafter.propose([request], 1, proposals=repeat)
        drafted.append(len(request.spec_token_ids))
        drafter.observe("r", len(request.spec_token_ids), 0)  # every draft misses
    pause = drafted.index(0)
    retries = [step for step in range(pause, 64) if drafted[step]]
    # retries after 4, 8, 16 and 32 steps without drafts, one step each
    assert [b - a for a, b in zip([pause - 1] + retries, retries)] == [5, 9, 17, 33][
        :len(retries)] and len(retries) >= 3
    drafter.propose([request], 1, proposals=repeat)
    drafter.observe("r", len(request.spec_token_ids), 0)
    for _ in range(40):  # the answer starts copying: the next retry's drafts are accepted
        drafter.propose([request], 1, proposals=repeat)
        drafter.observe("r", len(request.spec_token_ids), len(request.spec_token_ids))
    assert len(request.spec_token_ids) == 4


def test_step_costs_are_profiled_on_steps_that_sample_every_token(tiny_model_dir):
    """The start-up curve times steps whose every token is sampled (n one-token prompts: the
    shape of a decode batch or a verification), up to max_num_seqs tokens, and leaves no
    request, block or prefix-cache entry behind."""
    from kvserve import LLM
    from kvserve.core.scheduler import Scheduler

    shapes = []
    schedule = Scheduler.schedule

    def recording_schedule(scheduler):
        output = schedule(scheduler)
        shapes.append((len(output.scheduled), output.num_batched_tokens))
        return output

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "schedule", recording_schedule)
        llm = LLM(model=str(tiny_model_dir), dtype="float32", engine_core="thread",
                  max_num_seqs=8, speculative_config=NGRAM)
    core = llm.llm_engine.engine_core
    assert set(core.drafter.cost.points()) == {1, 2, 4, 8}
    profiled = [shape for shape in shapes if shape[1] in (2, 4, 8)]
    assert profiled and all(requests == tokens for requests, tokens in profiled)
    # then the price of attention reads: 4 requests each computing 4 new tokens over a cached
    # prefix of its own, long or one block, alternated over 6 rounds
    from kvserve.core.engine_core import READ_PROFILE_ROUNDS

    assert shapes.count((4, 16)) == 2 * READ_PROFILE_ROUNDS
    assert core.drafter.cost.read_seconds >= 0
    assert not core.has_unfinished()
    assert core.kv_manager.num_free_blocks == core.num_kv_blocks
    llm.shutdown()


def test_a_draft_must_raise_tokens_per_second_by_more_than_the_margin():
    """At 16 requests a 95%-accepted draft adds ~1% to tokens per second on this curve: inside
    the cost model's error (the front-end, a draft's logits and sampling), so none is given; a
    single stream's drafts pay by far more and are kept."""
    from kvserve.spec_decode.cost import MIN_GAIN

    linear = StepCostModel({1: 0.006, 64: 0.069})  # 5 ms a step plus 1 ms a token
    batch = {index: [0.95, 0.9] for index in range(16)}
    gain = (16 + 0.95) / 16 / (linear.cost(17) / linear.cost(16)) - 1
    assert 0 < gain < MIN_GAIN
    assert set(allocate_drafts(16, batch, linear).values()) == {0}
    assert allocate_drafts(1, {"one": [0.95, 0.9, 0.85]}, linear) == {"one": 3}
    # where not even a sure draft pays, the drafter allows the worker's proposer no drafts
    from types import SimpleNamespace

    from kvserve.spec_decode.config import SpeculativeConfig
    from kvserve.spec_decode.cost import a_draft_can_pay
    from kvserve.spec_decode.drafter import Drafter

    assert not a_draft_can_pay(16, 16, linear) and a_draft_can_pay(1, 1, linear)

    class Grammar:  # structured output's forced spans, as the engine always has them
        def __init__(self):
            self.asked = 0

        def drafts(self, request_id, spec, outputs, proposed):
            self.asked += 1
            return proposed, False

    class Running:  # hashed by identity, as the scheduler's requests
        def __init__(self, index, spec=None):
            self.request_id, self.spec_token_ids, self.num_tokens = str(index), [1], 40
            self.all_token_ids, self.num_prompt_tokens, self.output_token_ids = [1, 2, 3], 2, [3]
            self.max_tokens, self.num_output_tokens = 9, 1
            self.sampling_params = SimpleNamespace(structured_outputs=spec)

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    for grammar in (None, Grammar()):
        drafter = Drafter(config, linear, grammar=grammar)
        requests = [Running(index) for index in range(16)]
        assert drafter.limits(requests, 16) == {}
        drafter.propose(requests, 16, proposals={})
        assert all(request.spec_token_ids == [] for request in requests)
    # a constrained request may get forced spans (their own prior): the proposals go on
    grammar = Grammar()
    drafter = Drafter(config, linear, grammar=grammar)
    requests = [Running(index) for index in range(15)] + [Running(15, object())]
    assert set(drafter.limits(requests, 16).values()) == {4}
    drafter.propose(requests, 16, proposals={})
    assert grammar.asked == 1


def test_outputs_of_requests_never_asked_for_drafts_still_join_the_suffix_store():
    """At a batch where no draft can pay the drafter allows none; the worker's suffix proposer
    still follows those requests, so their outputs draft later requests (before, they were
    lost)."""
    from types import SimpleNamespace

    from kvserve.spec_decode.config import SpeculativeConfig
    from kvserve.spec_decode.drafter import Drafter
    from kvserve.spec_decode.proposers import ContextProposals, ProposalStep

    linear = StepCostModel({1: 0.006, 64: 0.069})  # no draft pays at 16 requests
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
    drafter, proposals = Drafter(config, linear), ContextProposals(config)
    requests = [SimpleNamespace(request_id=str(n), all_token_ids=[0, 1000 + n],
                                prompt_token_ids=[0], num_tokens=2, spec_token_ids=[])
                for n in range(16)]
    limits = drafter.limits(requests, 16)
    assert limits == {}
    assert proposals.propose(ProposalStep({r.request_id: r for r in requests},
                                          {r.request_id: r.all_token_ids[-1:] for r in requests},
                                          limits)) == {}
    for request in requests:  # the answers go on after the skipped proposal
        request.all_token_ids += [2000 + request.all_token_ids[1], 7, 8, 9]
        proposals.finish(request.request_id)
    assert proposals.proposer.propose("later", [5, 1003, 3003], 1) == [7, 8]


def test_stale_sizes_of_the_step_cost_curve_make_no_draft_look_free():
    """The medians of an s12 run (64 requests at once, Zen 4, ms): the start-up profile's 32
    tokens was never measured again, while 28 and 35 were, under load. Read as they are, a
    draft from 28 to 32 tokens costs nothing and the proposer ran on every step; the curve
    the allocation reads rises everywhere."""
    from kvserve.spec_decode.cost import a_draft_can_pay

    medians = {1: 5.3, 2: 5.5, 4: 7.8, 8: 12.0, 16: 21.4, 20: 40.0, 28: 56.6, 32: 39.4,
               35: 63.7, 42: 80.9, 50: 84.6, 57: 95.2, 64: 106.1}
    curve = StepCostModel({size: ms / 1000 for size, ms in medians.items()})
    costs = [curve.cost(size) for size in range(1, 65)]
    assert all(later > earlier for earlier, later in zip(costs, costs[1:]))
    assert curve.points()[32] == pytest.approx(0.0394)  # the medians themselves are kept
    assert not any(a_draft_can_pay(size, size, curve) for size in (28, 32, 42, 64))
    assert a_draft_can_pay(1, 1, curve)


def test_a_draft_is_priced_by_the_context_its_query_attends_over():
    """s3 on Zen 4 (8 requests over 1,100-token contexts): the batch's own size was measured
    with its attention (16.5 ms at 8 tokens) and 16 tokens only at start-up on one-token
    contexts (17.9 ms), so 8 drafts looked nearly free and made the step 30 ms. With attention
    priced per query and context token, the curve keeps the context-free part of each step and
    a draft costs its request's context: none pays at 1,100 tokens, one well accepted does at
    50."""
    from kvserve.spec_decode.cost import attention_reads

    curve = StepCostModel({1: 0.0047, 8: 0.0094, 16: 0.0179}, read_seconds=0.9e-6)
    for _ in range(15):  # decode steps of the 8 requests, as measured
        curve.observe(8, 0.0165, reads=8 * attention_reads(1, 1100))
    assert curve.cost(8) == pytest.approx(0.0165 - 0.9e-6 * 8800)  # the context-free part
    assert curve.cost(8, 8 * 1100) == pytest.approx(0.0165)
    gains = {n: [0.6, 0.36] for n in range(8)}
    long = allocate_drafts(8, gains, curve, base_reads=8 * 1100,
                           draft_reads=dict.fromkeys(gains, 1100))
    assert sum(long.values()) == 0
    unpriced = StepCostModel({1: 0.0047, 8: 0.0094, 16: 0.0179})
    for _ in range(15):
        unpriced.observe(8, 0.0165)
    assert sum(allocate_drafts(8, gains, unpriced).values()) >= 4  # as the engine did before
    assert attention_reads(64, 1100) == 0  # long prompt chunks stay in the curve (flash)
    short = StepCostModel({1: 0.0047, 2: 0.0050, 8: 0.0094}, read_seconds=0.9e-6)
    one = allocate_drafts(1, {"a": [0.9]}, short, base_reads=50, draft_reads={"a": 50})
    assert one == {"a": 1}


def test_cost_model_is_robust_to_one_off_stalls():
    model = StepCostModel()
    for _ in range(5):
        model.observe(4, 0.010)
    model.observe(4, 2.0)  # a first call of a shape, a neighbour's burst
    assert model.cost(4) == pytest.approx(0.010)
    model.observe(100, 0.5)  # sizes above 64 share a power-of-two class
    assert 128 in model.points()


# ---- verification -------------------------------------------------------------------------
VOCAB = 8


def _row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [0], [], None)


def _logits(*best: int) -> torch.Tensor:
    """One row per position: token `b` at 3.0, token 1 at 2.5, the rest 0."""
    rows = torch.zeros(len(best), VOCAB)
    rows[:, 1] = 2.5
    for i, b in enumerate(best):
        rows[i, b] = 3.0
    return rows


def test_greedy_accepts_drafts_equal_to_the_argmax_then_corrects():
    sampler = Sampler(0)
    rows = [_row(temperature=0), _row(temperature=0)]
    logits = torch.cat([_logits(4, 5, 6), _logits(2, 3)])
    out = sampler.verify(logits, rows, [[4, 7], [2]])
    assert out.token_ids == [[4, 5], [2, 3]]  # row 0: 7 rejected, 5 in its place; row 1: bonus
    assert all(row.output_token_ids == [] for row in rows)  # restored


def test_greedy_rows_verify_by_one_argmax_as_the_depth_loop_does():
    """Greedy rows without logprobs or argmax-moving processors take one argmax over all rows
    (`_verify_by_argmax`); the same logits and drafts through the depth loop (a row asking for
    logprobs turns the shortcut off) emit the same tokens: a full match with its bonus token, a
    first-draft miss, a mismatch mid-way, and a row without drafts."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(12, VOCAB, generator=generator)
    best = logits.argmax(dim=-1).tolist()
    drafts = [best[0:3], [(best[4] + 1) % VOCAB, 5], [best[7], (best[8] + 1) % VOCAB, 2], []]
    fast = Sampler(0).verify(logits, [_row(temperature=0) for _ in drafts], drafts)
    slow_rows = [_row(temperature=0) for _ in drafts[:-1]] + [_row(temperature=0, logprobs=1)]
    slow = Sampler(0).verify(logits, slow_rows, drafts)
    assert fast.token_ids == slow.token_ids == [best[0:4], [best[4]], best[7:9], [best[11]]]
    assert fast.logprobs == [None] * 4


def test_penalties_count_the_accepted_drafts():
    """Frequency penalty 1.0: after the accepted draft 5, token 5 drops to 2.0 < 2.5, so the
    second draft 5 is rejected, as a one-token-at-a-time run would have decided."""
    out = Sampler(0).verify(_logits(5, 5, 5), [_row(temperature=0, frequency_penalty=1.0)],
                            [[5, 5]])
    assert out.token_ids == [[5, 1]]


def test_min_tokens_masks_a_drafted_eos():
    params = SamplingParams(temperature=0, min_tokens=2)
    params.all_stop_token_ids = {5}
    out = Sampler(0).verify(_logits(5, 5), [SamplingRow(params, [0], [], None)], [[5]])
    assert out.token_ids == [[1]]


def test_logprobs_are_the_targets_of_each_emitted_token():
    logits = _logits(4, 5, 6)
    out = Sampler(0).verify(logits, [_row(temperature=0, logprobs=2)], [[4, 7]])
    expected = torch.log_softmax(logits, dim=-1)
    assert [lp.token_id for lp in out.logprobs[0]] == [4, 5]
    assert out.logprobs[0][0].logprob == pytest.approx(float(expected[0, 4]))
    assert out.logprobs[0][1].logprob == pytest.approx(float(expected[1, 5]))
    assert out.logprobs[0][1].top[0][0] == 5


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.0, top_p=0.8, min_p=0.05)],
                         ids=["plain", "top-k", "top-p-min-p"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """A point-mass draft (token 2) accepted with q(2), else a draw from q without 2: over
    10,000 trials the first emitted token follows q, the distribution sampling without
    drafts draws from, within 0.018 per token (3.6 standard errors at most)."""
    logits = torch.tensor([[1.0, 0.2, 1.5, -0.5, 0.7, 2.0, -1.0, 0.0],
                           [0.0] * VOCAB])
    reference = Sampler(0)
    filtered = reference._random_logits(logits[:1].clone(), [0], [SamplingParams(**params)])
    target = torch.softmax(filtered[0], dim=-1)
    sampler = Sampler(1)
    counts = torch.zeros(VOCAB)
    trials = 10000
    for _ in range(trials):
        out = sampler.verify(logits, [_row(**params)], [[2]])
        counts[out.token_ids[0][0]] += 1
    assert torch.allclose(counts / trials, target, atol=0.018), (counts / trials, target)


def test_seeded_rows_verify_the_same_way_every_time():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        row = SamplingRow(SamplingParams(temperature=1.0, seed=7), [0], [],
                          torch.Generator().manual_seed(7))
        runs.append(Sampler(0).verify(logits, [row], [[3, 4]]).token_ids)
    assert runs[0] == runs[1]


# ---- the scheduler ------------------------------------------------------------------------
def test_drafts_take_budget_and_rejected_ones_step_back():
    from kvserve.core.kv_cache.manager import KVCacheManager
    from kvserve.core.scheduler import Scheduler, SchedulerConfig
    from kvserve.protocol.worker import ModelRunnerOutput
    from tests.helpers import make_request

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64),
                          KVCacheManager(64, 4, enable_prefix_caching=True))
    request = make_request("r", list(range(10)), max_tokens=20)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({"r": [50]}, {}))
    request.spec_token_ids = [51, 52, 53]
    output = scheduler.schedule()
    (item,) = output.scheduled
    assert (item.num_new_tokens, item.num_draft_tokens) == (4, 3) and item.sample
    assert item.token_ids == [50, 51, 52, 53]
    scheduler.update_from_output(output, ModelRunnerOutput({"r": [51, 60]}, {},
                                                           num_rejected_tokens={"r": 2}))
    assert request.output_token_ids == [50, 51, 60]
    assert request.num_computed_tokens == 12 and request.spec_token_ids == []
    # only full blocks of real tokens were cached: [0..3], [4..7], [8, 9, 50, 51]
    assert len(request.block_hashes) == 3


# ---- through the engine -------------------------------------------------------------------
REPETITIVE = ["def add(a, b):\n    return a + b\n\n" * 3 + "Now the same, renamed to plus:\n",
              "apple, banana, cherry, apple, banana, cherry, apple, banana, cherry,",
              "Monday, Tuesday, Wednesday. Monday, Tuesday, Wednesday. Monday,",
              "<li>one</li>\n<li>two</li>\n<li>three</li>\n<li>"]


ENGINE_CASES = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.3,
                               repetition_penalty=1.1, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=24, logit_bias={28: -5.0},
                               min_tokens=16),
                SamplingParams(temperature=0, max_tokens=32, stop=["cherry, apple"]),
                SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True)]
ENGINE_PROMPTS = [prompt for prompt in REPETITIVE for _ in ENGINE_CASES]
ENGINE_PARAMS = ENGINE_CASES * len(REPETITIVE)


@pytest.fixture(scope="module")
def without_drafts():
    """The engine cases without speculation, run once for every drafting method."""
    from kvserve import LLM

    return LLM(dtype="float32", engine_core="thread").generate(ENGINE_PROMPTS, ENGINE_PARAMS,
                                                               use_tqdm=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", [NGRAM, {"method": "suffix", "num_speculative_tokens": 6}],
                         ids=["ngram", "suffix"])
def test_engine_greedy_tokens_and_options_equal_no_drafts(method, without_drafts):
    """SmolLM2 in float32 on text that repeats (drafts are accepted), 24 requests in ragged
    batches: greedy tokens, logprobs, penalties, logit_bias, min_tokens, stop strings and
    n = 2 as without speculation. Drafts every step (`adaptive` off): at 24 requests the cost
    model would give few, and verification, not the allocation, is under test here."""
    from kvserve import LLM

    llm = LLM(dtype="float32", engine_core="thread",
              speculative_config={**method, "adaptive": False})
    with_drafts = llm.generate(ENGINE_PROMPTS, ENGINE_PARAMS, use_tqdm=False)
    stats = llm.llm_engine.engine_core.drafter.stats
    assert stats.num_accepted_tokens > 50, stats
    for plain, spec in zip(without_drafts, with_drafts):
        for a, b in zip(plain.outputs, spec.outputs):
            assert a.token_ids == b.token_ids and a.text == b.text
            if a.logprobs:
                for x, y in zip(a.logprobs, b.logprobs):
                    assert set(x) == set(y)
                    assert all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-4)
                               for t in x)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_seeded_sampling_with_drafts_is_reproducible():
    """Each emitted token takes one draw from the request's generator, drafts or not, so the
    same seed gives the same tokens however many drafts the step-cost model (which follows
    the machine's load) handed out."""
    from kvserve import LLM

    llm = LLM(dtype="float32", engine_core="thread", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40,
                            ignore_eos=True)
    first = llm.generate(REPETITIVE, params, use_tqdm=False)
    second = llm.generate(REPETITIVE, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert llm.llm_engine.engine_core.drafter.stats.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_server_reports_drafts_in_usage_and_metrics(tiny_model_dir, tiny_llm, tmp_path):
    """`kvserve serve --speculative-config` (engine core in its own process): the same greedy
    text as the offline engine without drafts, OpenAI's predicted-output counts in `usage`,
    and the spec_decode counters in /metrics."""
    import httpx

    from kvserve.testing.server import ServerProcess
    from tests.helpers import read_metrics, tiny_server_flags

    prompt = "one two three one two three one two three one two"
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = tiny_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    flags = tiny_server_flags(tiny_model_dir, "--speculative-config", json.dumps(
        {**NGRAM, "prompt_lookup_min": 1, "adaptive": False}))
    with ServerProcess(flags, log_path=tmp_path / "server.log") as server:
        answer = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}).json()
        metrics = read_metrics(server.base_url)
    assert answer["choices"][0]["text"] == expected
    details = answer["usage"]["completion_tokens_details"]
    drafted = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
    assert drafted > 0
    assert metrics["kvserve:spec_decode_num_draft_tokens_total"] == drafted
    assert metrics["kvserve:spec_decode_num_accepted_tokens_total"] == \
        details["accepted_prediction_tokens"]
    assert metrics.get("kvserve:spec_decode_num_accepted_tokens_per_pos_total", 0) == \
        details["accepted_prediction_tokens"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("tp, engine_core", [(2, "thread"), (1, "process")])
def test_drafts_change_no_token_with_preemption_prefix_hits_and_tp(tiny_model_dir, tp,
                                                                   engine_core):
    """The mixed workload (17 greedy samples in ragged batches, a shared prefix, n = 2, a stop
    string, a pool small enough to preempt) with every draft kept: the tokens and logprobs of
    the run without drafts, on two tensor-parallel worker processes, and on one rank with
    the engine core in its own process."""
    from kvserve import LLM
    from tests.helpers import run_mixed_workload, single_process_reference, small_pool_options

    expected, expected_logprobs, _ = single_process_reference(tiny_model_dir)
    speculative = {**NGRAM, "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM(model=str(tiny_model_dir), tensor_parallel_size=tp, engine_core=engine_core,
              speculative_config=speculative,
              distributed_executor_backend="mp" if tp > 1 else None, **small_pool_options())
    try:
        tokens, logprobs = run_mixed_workload(llm)
        assert tokens == expected
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-4
        if engine_core == "thread":
            core = llm.llm_engine.engine_core
            assert core.drafter.stats.num_accepted_tokens > 0
            assert core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


def _chi_square_p(first: dict, second: dict) -> float:
    """p-value of a two-sample chi-square test that two count tables come from one
    distribution (cells with fewer than 10 samples in both merged; Wilson-Hilferty's
    approximation of the chi-square tail, no scipy here)."""
    cells = set(first) | set(second)
    big = [c for c in cells if first.get(c, 0) + second.get(c, 0) >= 10]
    rest = [c for c in cells if c not in big]
    table = [(first.get(c, 0), second.get(c, 0)) for c in big]
    table.append((sum(first.get(c, 0) for c in rest), sum(second.get(c, 0) for c in rest)))
    n1, n2 = sum(a for a, _ in table), sum(b for _, b in table)
    statistic = 0.0
    for a, b in table:
        if a + b:
            expected_a, expected_b = (a + b) * n1 / (n1 + n2), (a + b) * n2 / (n1 + n2)
            statistic += (a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b
    df = len(table) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def small_vocab_model_dir(tmp_path_factory, tokenizer):
    """The tiny model with 512 tokens: sampling 10,000 rows costs little."""
    from kvserve.testing.tiny import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-v512"), tokenizer,
                                vocab_size=512)


@pytest.mark.soak  # ~2 minutes: `make test-soak`; the sampler's own test covers the maths
def test_sampled_tokens_follow_the_same_distribution_with_drafts(small_vocab_model_dir):
    """10,000 samples of three tokens with temperature, top-p, a frequency penalty and a
    logit_bias, where the second token is verified against a prompt-lookup draft: the
    (first, second) pairs pass a two-sample chi-square test against the run without drafts
    (p > 0.001; the runs are seeded, so the test is deterministic), and each pair's logprobs
    are equal within 1e-4."""
    from collections import Counter

    from kvserve import LLM

    params = SamplingParams(temperature=0.05, top_p=0.9, frequency_penalty=0.3, n=125,
                            logit_bias={300: 0.02}, max_tokens=3, ignore_eos=True, logprobs=0)
    speculative = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3, "adaptive": False}
    counts, logprobs, prompt = [], [], None
    for extra in ({}, {"speculative_config": speculative}):
        llm = LLM(model=str(small_vocab_model_dir), dtype="float32", engine_core="thread",
                  **extra)
        if prompt is None:  # the model's own greedy text: its drafts are often right
            greedy = llm.generate({"prompt_token_ids": [100, 200]}, SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
            prompt = {"prompt_token_ids": [100, 200] + greedy[0].outputs[0].token_ids}
        outputs = llm.generate([prompt] * 80, params, use_tqdm=False)
        samples = [o for out in outputs for o in out.outputs]
        counts.append(Counter(tuple(o.token_ids[:2]) for o in samples))
        logprobs.append({tuple(o.token_ids[:2]): [step[t].logprob for step, t in
                                                   zip(o.logprobs, o.token_ids[:2])]
                         for o in samples})
        if extra:
            stats = llm.llm_engine.engine_core.drafter.stats
            assert stats.num_draft_tokens >= 5000 and stats.num_accepted_tokens > 1000
    assert sum(counts[0].values()) == sum(counts[1].values()) == 10000
    assert _chi_square_p(counts[0], counts[1]) > 0.001
    for pair in set(logprobs[0]) & set(logprobs[1]):
        assert logprobs[0][pair] == pytest.approx(logprobs[1][pair], abs=1e-4)


# ---- draft_model: a smaller model with the target's tokenizer ----------------------------------
@pytest.fixture(scope="module")
def draft_model_dir(tmp_path_factory, tokenizer):
    """Another tiny random model (other weights, one layer) with the target's tokenizer."""
    from kvserve.testing.tiny import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-draft"), tokenizer, seed=1,
                                num_hidden_layers=1)


def _draft_proposer(model_dir, target_dir, target_num_blocks: int = 200,
                    target_vocab_size: int = 49152):
    from kvserve.model_source import resolve_model
    from kvserve.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(
        str(model_dir), 3, target_vocab_size=target_vocab_size,
        target_tokenizer_source=resolve_model(str(target_dir)), dtype=torch.float32,
        device="cpu", attention_backend="paged", use_cpu_kernels=True, quantization="auto",
        block_size=4, target_num_blocks=target_num_blocks, max_num_seqs=1)


def test_draft_model_config_as_vllm_spells_it():
    config = parse_speculative_config({"model": "some-draft", "num_speculative_tokens": 3})
    assert (config.method, config.model) == ("draft_model", "some-draft")
    with pytest.raises(ValueError, match="'model'"):
        parse_speculative_config({"method": "ngram", "model": "x", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="'model'"):
        parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 3})


def test_draft_model_needs_the_targets_vocabulary(small_vocab_model_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="vocabulary has 512 tokens"):
        _draft_proposer(small_vocab_model_dir, tiny_model_dir)


def test_draft_kv_is_kept_between_proposals_and_rebuilt_after_eviction(draft_model_dir,
                                                                       tiny_model_dir):
    """Three requests drafted in turn: in a pool that holds one of them at a time each
    proposal evicts the others' draft KV and recomputes its own, and the drafts equal those of
    a pool that keeps everything (where accepted drafts are not fed again)."""
    small = _draft_proposer(draft_model_dir, tiny_model_dir, target_num_blocks=6)
    big = _draft_proposer(draft_model_dir, tiny_model_dir)
    sequences = {f"r{n}": list(range(5 + n, 25 + n)) for n in range(3)}
    for _ in range(2):
        for request_id, tokens in sequences.items():
            drafts = small.propose_batch([(request_id, tokens, 3)])
            assert drafts == big.propose_batch([(request_id, tokens, 3)])
            assert len(drafts[request_id]) == 3
            tokens.extend(drafts[request_id][:2] + [7])  # two accepted, then the bonus token
    # in one batch the small pool holds only the first; the second gets no drafts
    both = small.propose_batch([("r0", sequences["r0"], 3), ("r1", sequences["r1"], 3)])
    assert len(both["r0"]) == 3 and both["r1"] == []
    for request_id in list(sequences):
        small.finish(request_id)
    assert len(small._free) == small.num_blocks - 1


@pytest.mark.slow
def test_target_as_its_own_draft_model_gets_every_draft_accepted(tiny_model_dir, tiny_llm):
    """With the target as its own draft model, greedy drafts are the target's own argmax, so
    all are accepted unless the draft KV or positions slip (ragged batches, drafts fed back
    and kept across steps); the tokens are those without drafts."""
    from kvserve import LLM

    prompts = [" ".join(["word"] * n) + " end" for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in tiny_llm.generate(prompts, params,
                                                                      use_tqdm=False)]
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
              engine_core="thread", speculative_config={
                  "model": str(tiny_model_dir), "num_speculative_tokens": 3, "adaptive": False})
    try:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params,
                                                                use_tqdm=False)]
        stats = llm.llm_engine.engine_core.drafter.stats
    finally:
        llm.shutdown()
    assert got == expected
    assert stats.num_draft_tokens > 60
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens


@pytest.mark.slow
def test_draft_model_changes_no_token_with_preemption_and_prefix_hits(
        tiny_model_dir, draft_model_dir, mixed_workload_reference):
    """The mixed workload (ragged batches, a shared prefix, n = 2, a stop string, preemption)
    with a different draft model's every draft kept: the tokens and logprobs without drafts."""
    from kvserve import LLM
    from tests.helpers import run_mixed_workload, small_pool_options

    expected, expected_logprobs, _ = mixed_workload_reference(tiny_model_dir)
    llm = LLM(model=str(tiny_model_dir), engine_core="thread", speculative_config={
        "model": str(draft_model_dir), "num_speculative_tokens": 3, "adaptive": False},
        **small_pool_options())
    try:
        tokens, logprobs = run_mixed_workload(llm)
        core = llm.llm_engine.engine_core
        assert core.drafter.stats.num_draft_tokens > 0
        assert core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    assert tokens == expected
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-4
