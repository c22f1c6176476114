"""The persistent batch (worker/input_batch.py): each sampling request keeps its row, and the
events it emits (rows added, removed, moved; a reset after a step that never reached the
processors) keep every logits processor's per-row state right; the built-in processors on this
persistent path draw what a fresh batch draws each step."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.protocol.worker import NewRequestData
from kvserve.sample.logits_processor import (
    BatchUpdate,
    MoveDirection,
    MovedRow,
    apply_batch_update,
)
from kvserve.sample.sampler import Sampler, SamplingRow
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.request_state import CachedRequestState


# ---- the persistent batch's events -------------------------------------------------------------

def request(name: str, **params) -> CachedRequestState:
    return CachedRequestState.from_new(NewRequestData(
        name, [1, 2, 3], SamplingParams(extra_args={"tag": name}, **params)))


def follow(states: dict[int, str], update: BatchUpdate) -> None:
    """A processor's view: row -> tag, through the events."""
    apply_batch_update(states, update, lambda row: row.params.extra_args["tag"])


def test_rows_are_kept_and_refilled():
    batch = InputBatch()
    a, b, c, d = (request(name) for name in "abcd")
    update = batch.update([a, b, c])
    assert [row.index for row in update.added] == [0, 1, 2] and not update.removed
    assert update.added[0].output_token_ids is a.output_token_ids  # the live list
    batch.applied()
    assert batch.update([c, a, b]).empty  # same requests, any step order: same rows
    batch.applied()
    update = batch.update([a, c])  # b finished: the last row fills its place
    assert (update.batch_size, list(update.removed), update.moved) == (
        2, [1], [MovedRow(2, 1, MoveDirection.UNIDIRECTIONAL)])
    assert batch.requests == [a, c]
    batch.applied()
    update = batch.update([c, d])  # a leaves as d joins: d takes a's row, nothing moves
    assert list(update.removed) == [0] and [r.index for r in update.added] == [0]
    assert not update.moved and batch.requests == [d, c]


def test_a_preempted_request_comes_back_with_its_outputs():
    batch = InputBatch()
    a, b = request("a"), request("b")
    batch.update([a, b])
    batch.applied()
    a.output_token_ids += [7, 8]
    batch.update([b])  # a preempted
    batch.applied()
    update = batch.update([b, a])
    assert [(r.index, r.output_token_ids) for r in update.added] == [(1, [7, 8])]


def test_an_update_that_never_reached_the_processors_is_followed_by_a_reset():
    batch = InputBatch()
    requests = [request(name) for name in "abcde"]
    batch.update(requests)
    batch.applied()
    batch.update(requests[:2])  # the step raised after this: never applied
    update = batch.update(requests[1:3])  # c takes a's row, as without the failure
    assert list(update.removed) == [0, 1, 2, 3, 4]
    assert [(r.index, r.params.extra_args["tag"]) for r in update.added] == [(0, "c"), (1, "b")]
    states: dict[int, str] = {3: "stale"}
    follow(states, update)
    assert states == {0: "c", 1: "b"}


@pytest.mark.parametrize("seed", range(5))
def test_processors_follow_the_batch_through_random_steps(seed):
    """Requests join, leave, come back and finish at random; now and then a step fails before
    its update is applied: a processor following the events always agrees with the batch."""
    rng = random.Random(seed)
    pool = [request(f"r{i}") for i in range(12)]
    batch, states = InputBatch(), {}
    for _ in range(200):
        step = rng.sample(pool, rng.randint(0, len(pool)))
        update = batch.update(step)
        if rng.random() < 0.1:
            continue  # the step raised before the processors took the update
        follow(states, update)
        batch.applied()
        assert states == {row: r.sampling_params.extra_args["tag"]
                          for row, r in enumerate(batch.requests)}
        assert sorted(batch.requests, key=id) == sorted(step, key=id)


def test_swaps_and_moves_carry_state():
    states = {0: "a", 1: "b", 3: "d"}
    apply_batch_update(states, BatchUpdate(4, moved=[MovedRow(0, 1, MoveDirection.SWAP),
                                                     MovedRow(3, 2, MoveDirection.SWAP)]),
                       lambda row: None)
    assert states == {0: "b", 1: "a", 2: "d"}
    apply_batch_update(states, BatchUpdate(2, removed=[0],
                                           moved=[MovedRow(2, 0, MoveDirection.UNIDIRECTIONAL)]),
                       lambda row: None)
    assert states == {0: "d", 1: "a"}


# ---- built-ins on the persistent path ------------------------------------------------------------

def test_builtins_on_the_persistent_batch_equal_a_fresh_batch_each_step():
    """Requests that ask for bias, min_tokens, penalties and min_p (greedy and seeded), joining
    and leaving over 30 steps: the sampler kept across steps with the batch's events (counts
    kept incrementally, min_tokens rows pruned) draws what a fresh sampler draws each step."""
    vocab = 300
    rng = random.Random(0)
    specs = [dict(temperature=0, logit_bias={5: 3.0, 9: -2.0}),
             dict(temperature=0, min_tokens=6, stop_token_ids=[4, 11]),
             dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
             dict(temperature=0.9, presence_penalty=1.0, min_p=0.05, seed=1),
             dict(temperature=1.1, min_p=0.2, top_k=40, seed=2),
             dict(temperature=0.7, top_p=0.9, seed=3, logit_bias={1: 5.0}),
             dict(temperature=0)]
    requests = []
    for i, spec in enumerate(specs):
        state = request(f"r{i}", **spec)
        state.sampling_params.all_stop_token_ids = {2, *state.sampling_params.stop_token_ids}
        state.prompt_token_ids = [rng.randrange(vocab) for _ in range(5)]
        requests.append(state)
    kept, batch = Sampler(seed=5), InputBatch()
    generators = {id(r): [torch.Generator().manual_seed(r.sampling_params.seed or 0)
                          for _ in range(2)] for r in requests}
    logits_gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        step = [r for r in requests if rng.random() < 0.8]
        if not step:
            continue
        update = batch.update(step)
        logits = torch.randn(len(step), vocab, generator=logits_gen) * 3
        rows = [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids,
                            generators[id(r)][0] if r.sampling_params.seed else None)
                for r in batch.requests]
        fresh_rows = [SamplingRow(r.sampling_params, r.prompt_token_ids,
                                  list(r.output_token_ids),
                                  generators[id(r)][1] if r.sampling_params.seed else None)
                      for r in batch.requests]
        tokens = kept(logits, rows, update).token_ids
        batch.applied()
        assert tokens == Sampler(seed=5)(logits, fresh_rows).token_ids
        for r, token in zip(batch.requests, tokens):
            r.output_token_ids.append(token)
    min_tokens_output = requests[1].output_token_ids
    assert not {2, 4, 11} & set(min_tokens_output[:6])


def test_requests_without_processors_leave_them_idle():
    sampler = Sampler()
    sampler(torch.randn(2, 50), [SamplingRow(SamplingParams(temperature=0), [], [], None)] * 2)
    assert not any(p.is_active() for p in sampler.processors)
