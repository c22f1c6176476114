"""Sampler: each knob on hand-made logits, and seeded draws independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.core.sampler import Sampler, SamplingRow
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams

VOCAB = 10


def row(prompt=(), output=(), seed=None, **params) -> SamplingRow:
    sampling = SamplingParams(**params)
    sampling.all_stop_token_ids = {2} | set(sampling.stop_token_ids)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(sampling, list(prompt), list(output), generator)


def logits_for(*rows_values) -> torch.Tensor:
    return torch.tensor(rows_values, dtype=torch.float32)


BASE = [0.0, 1.0, 5.0, 3.0, 2.9, 0.5, -1.0, 0.0, 0.1, 0.2]


def test_greedy_is_argmax():
    assert Sampler()(logits_for(BASE), [row(temperature=0)]).token_ids == [2]


def test_top_k_one_and_tiny_top_p_are_greedy():
    sampler = Sampler(seed=3)
    for _ in range(20):
        assert sampler(logits_for(BASE), [row(temperature=1.5, top_k=1)]).token_ids == [2]
        assert sampler(logits_for(BASE), [row(temperature=1.5, top_p=1e-6)]).token_ids == [2]


def test_top_k_restricts_support():
    sampler = Sampler(seed=0)
    drawn = {sampler(logits_for(BASE), [row(temperature=5.0, top_k=3)]).token_ids[0]
             for _ in range(200)}
    assert drawn <= {2, 3, 4} and len(drawn) > 1


def test_min_p_removes_unlikely_tokens():
    sampler = Sampler(seed=0)
    drawn = {sampler(logits_for(BASE), [row(temperature=1.0, min_p=0.5)]).token_ids[0]
             for _ in range(200)}
    assert drawn == {2}  # 3 has p(3)/p(2) = e^-2 < 0.5


def test_logit_bias_can_force_a_token():
    assert Sampler()(logits_for(BASE), [row(temperature=0, logit_bias={7: 100})]).token_ids == [7]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = logits_for(BASE)
    assert Sampler()(logits, [row(temperature=0, min_tokens=1)]).token_ids == [3]
    assert Sampler()(logits, [row(temperature=0, min_tokens=2, output=[5],
                                  stop_token_ids=[3])]).token_ids == [4]
    assert Sampler()(logits, [row(temperature=0, min_tokens=1, output=[5])]).token_ids == [2]


def test_penalties():
    logits = logits_for(BASE)
    assert Sampler()(logits, [row(temperature=0, output=[2, 2, 2],
                                  frequency_penalty=1.0)]).token_ids == [3]
    closer = logits.clone()
    closer[0, 2] = 4.5  # 4.5 - 2 < 3
    assert Sampler()(closer, [row(temperature=0, output=[2],
                                  presence_penalty=2.0)]).token_ids == [3]
    assert Sampler()(logits, [row(temperature=0, prompt=[2],
                                  repetition_penalty=2.0)]).token_ids == [3]


def test_logprobs_are_raw_log_softmax():
    logits = logits_for(BASE)
    out = Sampler()(logits, [row(temperature=0, logprobs=3)])
    lp = out.logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert lp.token_id == 2 and lp.rank == 1
    assert math.isclose(lp.logprob, float(expected[2]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [2, 3, 4]


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    alone = [Sampler(seed=1)(logits[:1], [row(seed=42, temperature=1.0)]).token_ids[0]
             for _ in range(1)]
    seq_alone, seq_batched = [], []
    solo, batch = row(seed=42, temperature=1.0), row(seed=42, temperature=1.0)
    s1, s2 = Sampler(seed=1), Sampler(seed=99)
    for _ in range(10):
        seq_alone.append(s1(logits[:1], [solo]).token_ids[0])
        mixed = s2(logits[[1, 0, 2]], [row(temperature=1.0), batch, row(temperature=0.7)])
        seq_batched.append(mixed.token_ids[1])
    assert seq_alone == seq_batched
    assert alone[0] == seq_alone[0]


@pytest.mark.parametrize("bad", [dict(n=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(max_tokens=0), dict(min_p=2), dict(logprobs=50),
                                 dict(stop=[""]), dict(min_tokens=5, max_tokens=2),
                                 dict(presence_penalty=3), dict(logit_bias={1: 500})])
def test_invalid_params_raise_typed_errors(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)
