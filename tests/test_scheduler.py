"""Scheduler + KV manager with a fake runner: budgets, chunking, preemption, aborts, and a
property-based test that nothing is lost, duplicated or leaked."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.protocol.worker import ModelRunnerOutput
from kvserve.sampling_params import SamplingParams
from tests.helpers import bounded

EOS = 2


def make_scheduler(num_blocks=16, block_size=4, **config) -> Scheduler:
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)
    defaults.update(config)
    return Scheduler(SchedulerConfig(**defaults), KVCacheManager(num_blocks, block_size))


def make_request(request_id, prompt_len, max_tokens=4, priority=0, seed_token=10) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    params.all_stop_token_ids = {EOS}
    prompt = [seed_token + (i % 7) for i in range(prompt_len)]
    return Request(request_id, prompt, params, max_tokens, priority)


def fake_step(scheduler: Scheduler, token_for=lambda request: 5):
    output = scheduler.schedule()
    sampled = {s.request.request_id: [token_for(s.request)] for s in output.scheduled
               if s.sample}
    finished = scheduler.update_from_output(output, ModelRunnerOutput(sampled, {}))
    return output, finished


def test_decode_and_chunked_prefill_share_a_step():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("short", 3))
    first, _ = fake_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("short", 3)]
    scheduler.add_request(make_request("long", 20))
    second, _ = fake_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in second.scheduled] == [
        ("short", 1, True), ("long", 7, False)]
    third, _ = fake_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in third.scheduled] == [
        ("short", 1), ("long", 7)]


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 2))
    output, _ = fake_step(scheduler)
    assert len(output.scheduled) == 2 and scheduler.num_waiting == 1


def test_max_num_partial_prefills_serves_a_burst_one_prompt_per_step():
    """Three short prompts at once: one prefill per step (each gets its first token after its own
    prefill, not everyone's), decodes of the earlier ones alongside; a prompt chunked over
    several steps holds its slot until done."""
    scheduler = make_scheduler(max_num_batched_tokens=32, max_num_partial_prefills=1)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 5, seed_token=10 * i))
    steps = [[(s.request.request_id, s.num_new_tokens) for s in fake_step(scheduler)[0].scheduled]
             for _ in range(3)]
    assert steps == [[("r0", 5)], [("r0", 1), ("r1", 5)], [("r0", 1), ("r1", 1), ("r2", 5)]]
    chunked = make_scheduler(max_num_batched_tokens=8, max_num_partial_prefills=1)
    chunked.add_request(make_request("long", 12))
    chunked.add_request(make_request("next", 3))
    first, _ = fake_step(chunked)
    second, _ = fake_step(chunked)
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("long", 8)]
    assert [(s.request.request_id, s.num_new_tokens) for s in second.scheduled] == [("long", 4)]
    unlimited = make_scheduler(max_num_batched_tokens=32)
    for i in range(3):
        unlimited.add_request(make_request(f"r{i}", 5, seed_token=10 * i))
    assert len(fake_step(unlimited)[0].scheduled) == 3
    with pytest.raises(ValueError, match="at least 1"):
        SchedulerConfig(max_num_partial_prefills=0)


def test_priority_policy_orders_waiting_and_picks_victims():
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    scheduler.add_request(make_request("low", 2, priority=5))
    scheduler.add_request(make_request("high", 2, priority=-1))
    output, _ = fake_step(scheduler)
    assert output.scheduled[0].request.request_id == "high"


def test_preemption_when_blocks_run_out_then_everyone_finishes():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 4, max_tokens=8, seed_token=10 * i))
    finished, steps = [], 0
    while scheduler.has_unfinished() and steps < 200:
        _, done = fake_step(scheduler)
        finished += done
        steps += 1
    assert sorted(r.request_id for r in finished) == ["r0", "r1", "r2"]
    assert scheduler.num_preemptions > 0
    assert all(r.num_output_tokens == 8 for r in finished)
    assert scheduler.kv.num_free_blocks == 4


def test_preempted_request_keeps_its_output_tokens():
    scheduler = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 4, max_tokens=6))
    scheduler.add_request(make_request("b", 4, max_tokens=6))
    counter = iter(range(100, 1000))
    seen: dict[str, list[int]] = {}
    for _ in bounded(200, "the two requests"):
        if not scheduler.has_unfinished():
            break
        _, done = fake_step(scheduler, token_for=lambda r: next(counter))
        for request in done:
            seen[request.request_id] = request.output_token_ids
    assert all(len(tokens) == 6 for tokens in seen.values())


def test_abort_anywhere_frees_everything():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("run", 6))
    scheduler.add_request(make_request("wait", 6))
    fake_step(scheduler)
    scheduler.finish_request("run", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("wait", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished()
    assert scheduler.kv.num_free_blocks == 16
    assert scheduler.finish_request("missing", RequestStatus.FINISHED_ABORTED) is None


def test_eos_min_tokens_and_ignore_eos():
    scheduler = make_scheduler()
    request = make_request("a", 2, max_tokens=5)
    request.sampling_params.min_tokens = 2
    scheduler.add_request(request)
    fake_step(scheduler, token_for=lambda r: EOS)  # below min_tokens: keeps going
    assert not request.is_finished
    fake_step(scheduler, token_for=lambda r: EOS)
    assert request.status == RequestStatus.FINISHED_STOPPED
    ignoring = make_request("b", 2, max_tokens=3)
    ignoring.sampling_params.ignore_eos = True
    scheduler.add_request(ignoring)
    for _ in range(3):
        fake_step(scheduler, token_for=lambda r: EOS)
    assert ignoring.status == RequestStatus.FINISHED_LENGTH and ignoring.num_output_tokens == 3


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 40)),
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=operations, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 8]),
       budget=st.integers(1, 40), policy=st.sampled_from(["fcfs", "priority"]),
       prefills=st.sampled_from([None, 1, 2]), seed=st.integers(0, 1000))
def test_random_sequences_lose_nothing(ops, num_blocks, block_size, budget, policy, prefills,
                                       seed):
    rng = random.Random(seed)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget,
                        max_model_len=num_blocks * block_size, policy=policy,
                        max_num_partial_prefills=prefills),
        KVCacheManager(num_blocks, block_size))
    capacity = num_blocks * block_size
    added: dict[str, Request] = {}
    ended: dict[str, Request] = {}

    def record(done):
        for request in done:
            assert request.request_id not in ended, "finished twice"
            ended[request.request_id] = request

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority = op
            if prompt_len + max_tokens > capacity:
                continue  # the engine rejects these up front
            request = make_request(f"r{len(added)}", prompt_len, max_tokens, priority,
                                   seed_token=rng.randint(3, 9))
            added[request.request_id] = request
            scheduler.add_request(request)
        elif op[0] == "step":
            record(fake_step(scheduler, token_for=lambda r: rng.choice([5, 6, EOS]))[1])
        else:
            target = f"r{op[1]}"
            done = scheduler.finish_request(target, RequestStatus.FINISHED_ABORTED)
            if done is not None:
                record([done])
    steps = 0
    while scheduler.has_unfinished():
        record(fake_step(scheduler, token_for=lambda r: rng.choice([5, 6, EOS]))[1])
        steps += 1
        assert steps < 5000, "scheduler made no progress"
    assert set(ended) == set(added)
    for request in ended.values():
        assert request.is_finished
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.max_tokens
        assert request.num_output_tokens <= request.max_tokens
    pool = scheduler.kv.pool
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert pool.num_free_blocks == num_blocks
    assert scheduler.kv.managers[0].req_blocks == {}
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash


def test_identical_prefixes_arriving_together_are_computed_once():
    """The second request waits while the first computes the shared blocks, then hits them."""
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    first, second = make_request("a", 13), make_request("b", 13)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step1, _ = fake_step(scheduler)
    assert [s.request.request_id for s in step1.scheduled] == ["a"]
    step2, _ = fake_step(scheduler)
    admitted = {s.request.request_id: s for s in step2.scheduled}
    assert admitted["b"].start_position == 12  # three full blocks hit
    assert scheduler.kv.block_ids("b")[:3] == scheduler.kv.block_ids("a")[:3]
    assert scheduler.kv.pending == {}


def test_pending_owner_preempted_releases_waiters():
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", 16))
    fake_step(scheduler)  # a computes its first chunk; its other blocks are pending
    scheduler.add_request(make_request("b", 16))
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.pending == {}
    output, _ = fake_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["b"]


def _submit(scheduler: Scheduler):
    """Schedule a batch and mark its requests in flight (as the pipelined engine core does)."""
    output = scheduler.schedule()
    scheduler.in_flight.update(s.request.request_id for s in output.scheduled)
    return output


def _complete(scheduler: Scheduler, output) -> None:
    sampled = {s.request.request_id: [5] for s in output.scheduled if s.sample}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled, {}))
    scheduler.in_flight.difference_update(s.request.request_id for s in output.scheduled)


def test_pipeline_batches_share_no_request_and_split_the_requests():
    scheduler = make_scheduler(pipeline_depth=2, num_blocks=32)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=6))
    first = _submit(scheduler)
    second = _submit(scheduler)
    ids = lambda output: {s.request.request_id for s in output.scheduled}  # noqa: E731
    assert ids(first) == {"r0", "r1"} and ids(second) == {"r2", "r3"}
    assert not _submit(scheduler).scheduled  # everyone is in flight: nothing to run
    _complete(scheduler, first)
    third = _submit(scheduler)
    assert ids(third) == {"r0", "r1"}
    assert all(s.num_new_tokens == 1 and s.start_position == 3 for s in third.scheduled)


def test_requests_in_flight_are_never_preempted():
    # 4 blocks of 4 tokens: two 7-token requests fill them; a's 9th token needs a third block
    scheduler = make_scheduler(pipeline_depth=2, num_blocks=4, max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", 7, max_tokens=8))
    scheduler.add_request(make_request("b", 7, max_tokens=8, seed_token=30))  # no shared prefix
    _complete(scheduler, _submit(scheduler))  # a's prompt
    second = _submit(scheduler)  # a's first decode (position 7: still its second block)
    third = _submit(scheduler)  # b's prompt takes the last two blocks
    assert [s.request.request_id for s in second.scheduled + third.scheduled] == ["a", "b"]
    _complete(scheduler, second)
    assert not _submit(scheduler).scheduled  # a needs a block; b, in flight, is not the victim
    assert scheduler.requests["b"].status == RequestStatus.RUNNING
    assert scheduler.requests["a"].status == RequestStatus.PREEMPTED  # a made way itself
    _complete(scheduler, third)
    assert scheduler.requests["b"].num_computed_tokens == 7


# ---- several tokens per step (speculative decoding's contract) ------------------------------
def _step_with(scheduler: Scheduler, tokens: list[int], rejected: int = 0):
    output = scheduler.schedule()
    (item,) = output.scheduled
    runner_output = ModelRunnerOutput({item.request.request_id: tokens} if item.sample else {},
                                      {}, {item.request.request_id: rejected})
    return output, scheduler.update_from_output(output, runner_output)


def test_a_stop_token_mid_list_drops_the_tokens_after_it():
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=10)
    scheduler.add_request(request)
    _, finished = _step_with(scheduler, [5, 6, EOS, 7])
    assert finished == [request] and request.output_token_ids == [5, 6, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv.pool.num_used_blocks == 0


def test_max_tokens_cuts_a_list_and_min_tokens_lets_eos_through_only_after_it():
    scheduler = make_scheduler()
    capped = make_request("capped", 5, max_tokens=3)
    scheduler.add_request(capped)
    _step_with(scheduler, [5, 6, 7, 8])
    assert capped.output_token_ids == [5, 6, 7]
    assert capped.status == RequestStatus.FINISHED_LENGTH
    early_eos = make_request("min", 5, max_tokens=8)
    early_eos.sampling_params.min_tokens = 2
    scheduler.add_request(early_eos)
    _step_with(scheduler, [EOS, 6, EOS, 9])
    assert early_eos.output_token_ids == [EOS, 6, EOS]  # the first EOS came before min_tokens


def test_tokens_that_arrive_together_are_computed_in_the_next_step():
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=10)
    scheduler.add_request(request)
    _step_with(scheduler, [5, 6, 7])
    assert request.num_computed_tokens == 5 and request.num_tokens == 8
    output, _ = _step_with(scheduler, [8])
    (item,) = output.scheduled
    assert (item.start_position, item.num_new_tokens, item.sample) == (5, 3, True)
    assert request.output_token_ids == [5, 6, 7, 8]


def test_rejected_positions_step_back_and_never_enter_the_prefix_cache():
    """A verification step of 8 positions keeps 5 (3 rejected): the second block, only partly
    computed now, stays unhashed; the next step computes from position 5 again."""
    scheduler = make_scheduler(block_size=4)
    request = make_request("r", 8, max_tokens=10)
    scheduler.add_request(request)
    _step_with(scheduler, [5], rejected=3)
    assert request.num_computed_tokens == 5
    cached = [block.block_hash is not None for block in scheduler.kv.managers[0].req_blocks["r"]]
    assert cached == [True, False]
    output, _ = _step_with(scheduler, [6])
    (item,) = output.scheduled
    assert (item.start_position, item.num_new_tokens) == (5, 4)
    assert request.num_computed_tokens == 9
    assert [block.block_hash is not None for block in scheduler.kv.managers[0].req_blocks["r"]] == \
        [True, True, False]
