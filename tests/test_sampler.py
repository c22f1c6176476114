"""Sampler: each knob on hand-made logits, and seeded draws independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.errors import InvalidRequestError
from kvserve.kernels import isa, reference
from kvserve.sample.sampler import Sampler, SamplingRow
from kvserve.sampling_params import SamplingParams
from tests.helpers import ops_of

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


def test_top_k_one_and_tiny_top_p_are_greedy(ops):
    sampler = Sampler(seed=3, ops=ops)
    for _ in range(20):
        assert sampler(logits_for(BASE), [row(temperature=1.5, top_k=1)]).token_ids == [2]
        assert sampler(logits_for(BASE), [row(temperature=1.5, top_p=1e-6)]).token_ids == [2]


def test_top_k_restricts_support(ops):
    sampler = Sampler(seed=0, ops=ops)
    drawn = {sampler(logits_for(BASE), [row(temperature=5.0, top_k=3)]).token_ids[0]
             for _ in range(200)}
    assert drawn <= {2, 3, 4} and len(drawn) > 1


def test_min_p_removes_unlikely_tokens(ops):
    sampler = Sampler(seed=0, ops=ops)
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


# --- top-k / top-p without sorting, against the sort it replaced --------------------------------

def reference_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                          stable: bool = False) -> torch.Tensor:
    """The sampler's former top-k/top-p, which sorted every row, verbatim. torch's CPU sort is not
    stable, so which of several tied logits survived a cut was arbitrary; stable=True makes it
    the lowest token ids, the rule the sampler now follows."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=stable)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k]).unsqueeze(1)
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    remove = before >= torch.tensor(top_p).unsqueeze(1)
    remove[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def reference_filtered_probs(logits: torch.Tensor, params: list[SamplingParams],
                             exact: bool = False, stable: bool = False) -> torch.Tensor:
    """The former filtered probabilities, a row at a time (each as if alone in its batch).

    exact=False is the former code bit for bit. exact=True runs its top-k/top-p in float64 and
    lets top_p = 1.0 keep everything: the rule the sampler now computes. (The float32 sort's
    softmax sums the row best first and drops the smallest tail terms, and its float32 running
    sum drifts by ~1e-5 over thousands of tokens: cuts near p = 0.99 moved by tens of tokens, and
    top_p = 1.0 cut the tail whenever the sum rounded past 1.0.)"""
    probs = []
    for row_logits, p in zip(logits, params):
        row_logits = row_logits.unsqueeze(0) / torch.tensor([[p.temperature]])
        if p.top_k > 0 or p.top_p < 1.0:
            if exact:
                top_p = p.top_p if p.top_p < 1.0 else float("inf")
                kept = reference_top_k_top_p(row_logits.double(), [p.top_k], [top_p], stable)
                row_logits = row_logits.masked_fill(torch.isneginf(kept), float("-inf"))
            else:
                row_logits = reference_top_k_top_p(row_logits, [p.top_k], [p.top_p], stable)
        row_probs = torch.softmax(row_logits, dim=-1)
        if p.min_p > 0:  # a logits processor: it masks the logits, the softmax renormalizes
            threshold = p.min_p * row_probs.max(dim=-1, keepdim=True).values
            row_probs = torch.softmax(row_logits.masked_fill(row_probs < threshold,
                                                             float("-inf")), dim=-1)
        probs.append(row_probs[0])
    return torch.stack(probs)


@pytest.fixture(scope="module", params=["torch", *isa.tested_levels()])
def ops(request):
    """The sampler's per-row passes (top-p, the draw) as torch ops, then compiled for each
    instruction-set level this machine can execute."""
    return ops_of(request.param)


@pytest.fixture(scope="module")
def once():
    """`once(key, compute)`: compute() the first time a key is asked for in this module, then
    its value. For what does not depend on the op set (the sort-based references and the
    logits they filter), which every op set's run of a test would otherwise recompute: the
    float64 sorts of 49k- and 262k-token rows were most of those tests' time."""
    values: dict = {}

    def value(key, compute):
        if key not in values:
            values[key] = compute()
        return values[key]

    yield value
    values.clear()


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams], ops=None) -> torch.Tensor:
    """The sampler's distributions for rows that all sample: temperature, top-k/top-p, then the
    min-p logits processor."""
    sampler = Sampler(ops=ops)
    rows = [SamplingRow(p, [], [], None) for p in params]
    sampler._update_processors(rows, None)
    return torch.softmax(sampler._random_logits(logits, list(range(len(rows))), params), dim=-1)


def assert_same_distribution(new: torch.Tensor, ref: torch.Tensor) -> None:
    """The same kept tokens in every row, with the same probabilities: the softmax runs on the
    same masked logits, so the same bits."""
    for i in range(ref.shape[0]):
        kept, ref_kept = new[i] > 0, ref[i] > 0
        assert torch.equal(kept, ref_kept), (
            f"row {i}: {int(kept.sum())} tokens kept, the reference keeps {int(ref_kept.sum())}")
    assert torch.equal(new, ref)


def model_like_logits(rows: int, vocab: int, spread: float, seed: int) -> torch.Tensor:
    """Logits whose softmax falls off like a language model's (a few likely tokens, a Zipf tail)
    in a random token order; `spread` scales them: 3 is peaked, 0.3 nearly flat."""
    gen = torch.Generator().manual_seed(seed)
    zipf = -torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    logits = spread * zipf + 0.5 * torch.randn(rows, vocab, generator=gen)
    return torch.stack([r[torch.randperm(vocab, generator=gen)] for r in logits])


def params_for(settings) -> list[SamplingParams]:
    return [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]


TYPICAL = [  # (temperature, top_k, top_p, min_p) as requests set them
    (1.0, 1, 1.0, 0.0),
    (0.8, 50, 1.0, 0.0),
    (0.8, 0, 0.95, 0.0),
    (0.8, 50, 0.95, 0.0),
    (0.7, 40, 0.9, 0.05),
    (1.0, 0, 0.9, 0.1),
    (1.3, 0, 1e-6, 0.0),
    (1.0, 0, 0.5, 0.0),
    (1.0, 0, 1.0, 0.2),  # min-p only
]
SETTINGS = TYPICAL + [
    (1.0, 0, 0.99, 0.0),
    (1.0, 0, 0.999, 0.0),
    (0.5, 0, 0.9999999, 0.0),
    (1.0, 1000, 0.99, 0.0),
    (2.0, 5000, 1.0, 0.0),
    (1.0, 300, 0.9999999, 0.0),
    (1.0, 10**9, 0.8, 0.0),  # top_k past the vocabulary: no top-k
]


@pytest.mark.parametrize("vocab", [49152, 262144])
@pytest.mark.parametrize("spread", [3.0, 1.5, 1.0, 0.3])
def test_filtered_probs_equal_the_sort_in_float64(vocab, spread, ops, once):
    """Each setting alone and all of them in one batch, on peaked to flat rows (flat ones take
    the histogram-sized window or the whole-row fallback): the sort's tokens, bit for bit."""

    params = params_for(SETTINGS)
    logits, expected = once(("float64 sort", vocab, spread), lambda: _float64_sort(
        model_like_logits(len(SETTINGS), vocab, spread, seed=int(spread * 10) + vocab), params))
    assert_same_distribution(filtered_probs(logits, params, ops), expected)
    for i in range(0, len(SETTINGS), 3 if vocab > 100_000 else 1):
        single = filtered_probs(logits[i:i + 1], params[i:i + 1], ops)
        assert_same_distribution(single, expected[i:i + 1])


def _float64_sort(logits: torch.Tensor, params: list[SamplingParams]):
    return logits, reference_filtered_probs(logits, params, exact=True)


@pytest.mark.parametrize("spread", [3.0, 1.5, 1.0])
def test_typical_settings_equal_the_former_float32_sort(spread, ops):
    """The usual settings at the usual vocabulary: the former code's tokens and probabilities,
    bit for bit (not a float64 rerun of it)."""

    logits = model_like_logits(len(TYPICAL), 49152, spread, seed=int(spread * 100))
    params = params_for(TYPICAL)
    assert_same_distribution(filtered_probs(logits, params, ops),
                             reference_filtered_probs(logits, params))


@pytest.mark.parametrize("vocab", [49152, 262144])
def test_the_float32_sort_differed_only_in_its_rounding(vocab, ops, once):
    """Where the former float32 code kept other tokens (top_p near 1, long tails, 262k rows):
    its softmax of the sorted row summed best first and lost the tail's smallest terms (at 262k
    its probabilities added up to 1.0001), so it cut early. The kept sets are nested, and they
    and the probabilities differ by less than 3e-4 (how much the former sums lost depends on the
    CPU's vector width: 2e-4 on AVX-512, 2.02e-4 at 262k on AVX2)."""

    params = params_for(SETTINGS)
    differing_rows = 0
    for spread in (3.0, 1.5, 1.0, 0.3):
        logits, old, unfiltered = once(("float32 sort", vocab, spread),
                                       lambda: _former_float32_sort(params, vocab, spread))
        new = filtered_probs(logits, params, ops)
        for i in range(len(params)):
            if torch.equal(new[i], old[i]):
                continue
            differing_rows += 1
            kept, old_kept = new[i] > 0, old[i] > 0
            assert bool((kept & ~old_kept).sum() == 0) or bool((old_kept & ~kept).sum() == 0)
            assert float(unfiltered[i][kept ^ old_kept].sum()) < 3e-4
            both = kept & old_kept
            torch.testing.assert_close(new[i][both], old[i][both], rtol=3e-4, atol=0)
    assert differing_rows > 0  # the case is real: this test would otherwise prove nothing


def _former_float32_sort(params: list[SamplingParams], vocab: int, spread: float):
    """Model-like logits, the former float32 code's distributions of them, and the unfiltered
    ones."""
    logits = model_like_logits(len(params), vocab, spread, seed=5)
    unfiltered = torch.softmax(logits / torch.tensor([[p.temperature] for p in params]), -1)
    return logits, reference_filtered_probs(logits, params), unfiltered


def test_every_window_path_is_taken(monkeypatch):
    """The first window, the histogram-sized window and the whole row, each against the sort."""
    from kvserve.kernels import top_p

    windows: list[int] = []
    real = top_p._nucleus_in_window

    def spy(logits, probs, top_p, window):
        windows.append(window)
        return real(logits, probs, top_p, window)

    monkeypatch.setattr(top_p, "_nucleus_in_window", spy)
    vocab = 49152
    for spread, top_p, widest in [(3.0, 0.9, 256), (1.1, 0.9, None), (0.2, 0.95, vocab)]:
        windows.clear()
        logits = model_like_logits(2, vocab, spread, seed=7)
        params = params_for([(1.0, 0, top_p, 0.0)] * 2)
        assert_same_distribution(filtered_probs(logits, params),
                                 reference_filtered_probs(logits, params, exact=True))
        if widest is None:
            assert 256 < max(windows) < vocab, windows
        else:
            assert max(windows) == widest, windows


@pytest.mark.parametrize("first_window", [1, 2, 5, 64])
def test_small_first_windows(monkeypatch, first_window):
    """Windows far smaller than the nucleus: every row widens, some twice, ties and -inf fall on
    window edges, and a window's last token can be its cut (what follows it is then unknown)."""
    from kvserve.kernels import top_p

    monkeypatch.setattr(top_p, "_FIRST_WINDOW", first_window)
    assert_small_rows_equal_the_sort(small_rows(seed=first_window), reference)


@pytest.mark.parametrize("seed", [1, 2])
def test_small_rows_in_every_op(seed, ops):
    """The same rows through each op set: in the compiled one, integer logits tie inside one
    histogram bucket and -inf tokens share the last."""
    assert_small_rows_equal_the_sort(small_rows(seed), ops)


def small_rows(seed: int) -> torch.Tensor:
    """500-token rows: peaked to flat, integer logits (big ties), half the tokens -inf."""
    gen = torch.Generator().manual_seed(seed)
    rows = [model_like_logits(1, 500, spread, seed=seed)[0] for spread in (3, 1, 0.3)]
    rows.append(torch.randint(0, 4, (500,), generator=gen).float())
    rows.append(torch.where(torch.rand(500, generator=gen) < 0.5, float("-inf"), rows[1]))
    return torch.stack(rows)


def assert_small_rows_equal_the_sort(logits: torch.Tensor, ops) -> None:
    for setting in SETTINGS + [(1.0, 3, 0.99, 0.0), (1.0, 0, 0.7, 0.0), (1.0, 0, 0.97, 0.0)]:
        params = params_for([setting] * len(logits))
        assert_same_distribution(filtered_probs(logits, params, ops),
                                 reference_filtered_probs(logits, params, True, True))


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_ties_at_the_cut_keep_the_lowest_token_ids(vocab, ops, once):
    """Integer logits tie in big groups, so top-k and top-p cuts fall inside one: as many tokens
    as the sort keeps, with the same probabilities, and of the tied ones the lowest ids (what a
    stable sort keeps; torch's sort, not stable, keeps an arbitrary few)."""

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 6, (4, vocab), generator=gen).float()
    logits[3] = 0.0  # one tie across the whole row
    for k in (0, 1, 2, 3, vocab // 3, vocab - 1, vocab):
        for p in (1.0, 0.6, 0.3, 0.05):
            params = params_for([(1.0, k, p, 0.0)] * 4)
            new = filtered_probs(logits, params, ops)
            stable, unstable_kept, unstable_sorted = once(("ties", vocab, k, p),
                                                          lambda: _tie_references(logits, params))
            assert_same_distribution(new, stable)
            assert torch.equal((new > 0).sum(dim=-1), unstable_kept)
            # the same values at other places: the softmax sums them in another order
            torch.testing.assert_close(new.sort(dim=-1).values, unstable_sorted)


def _tie_references(logits: torch.Tensor, params: list[SamplingParams]):
    """The stable sort's distribution; the unstable one's kept count and sorted values."""
    unstable = reference_filtered_probs(logits, params, exact=True)
    return (reference_filtered_probs(logits, params, True, True), (unstable > 0).sum(dim=-1),
            unstable.sort(dim=-1).values)


def test_masked_tokens_and_tiny_vocabularies(ops):
    """-inf logits (min_tokens, logit_bias) inside and at the edge of the first window; a row of
    fewer tokens than the window."""

    logits = model_like_logits(3, 2000, 2.0, seed=3)
    logits[0, logits[0].topk(300).indices[1:]] = float("-inf")  # one finite token left near top
    logits[1, logits[1].topk(700).indices[::2]] = float("-inf")
    logits[2, torch.arange(0, 2000, 3)] = float("-inf")
    short = torch.tensor([[0.5, 2.0, -1.0]])
    for setting in SETTINGS:
        params = params_for([setting] * 3)
        assert_same_distribution(filtered_probs(logits, params, ops),
                                 reference_filtered_probs(logits, params, exact=True))
        assert_same_distribution(filtered_probs(short, params[:1], ops),
                                 reference_filtered_probs(short, params[:1], exact=True))


def test_top_p_one_keeps_every_token_in_any_batch(ops):
    """The sort cut a top_p = 1.0 row's tail when another row of the batch filtered and its
    float32 running sum rounded past 1.0; now such a row is left whole, as it was when alone."""

    logits = torch.randint(0, 6, (2, 49152), generator=torch.Generator().manual_seed(0)).float()
    params = params_for([(1.0, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.0)])
    # (the former code cut this row's tail where torch's float32 cumsum rounded past 1.0: on
    # AVX-512 machines, not on AVX2 ones, whose reductions round differently)
    assert torch.equal(filtered_probs(logits, params, ops)[0], torch.softmax(logits[0], dim=-1))


def reference_tokens(logits: torch.Tensor, rows: list[SamplingRow], seeds: list[int | None],
                     steps: int) -> list[list[int | None]]:
    """What the former sampler drew for seeded rows: argmax(p / E), E ~ Exp(1) from each row's
    own generator, one draw over the whole vocabulary per step; None for other rows."""
    probs = reference_filtered_probs(logits, [r.params for r in rows])
    generators = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    tokens = []
    for _ in range(steps):
        step: list[int | None] = []
        for i, gen in enumerate(generators):
            if gen is None:
                step.append(None)
                continue
            noise = torch.empty(logits.shape[-1]).exponential_(generator=gen)
            step.append(int((probs[i] / noise).argmax()))
        tokens.append(step)
    return tokens


def test_seeded_draws_match_the_former_sampler(ops):
    """Same seed, same probabilities, same noise: the tokens the sorting sampler drew, in a batch
    that also holds greedy and unseeded rows."""
    logits = model_like_logits(5, 49152, 1.2, seed=11)
    specs = [  # (seed, params)
        (42, dict(temperature=0.8, top_p=0.95)),
        (None, dict(temperature=0.0)),
        (7, dict(temperature=0.8, top_k=50)),
        (None, dict(temperature=1.0, top_p=0.9)),
        (123, dict(temperature=1.2, top_k=200, top_p=0.7, min_p=0.01)),
    ]
    rows = [row(seed=seed, **params) for seed, params in specs]
    expected = reference_tokens(logits, rows, [seed for seed, _ in specs], steps=8)
    sampler = Sampler(seed=0, ops=ops)
    for step in expected:
        got = sampler(logits, rows).token_ids
        assert [got[i] for i, t in enumerate(step) if t is not None] == [
            t for t in step if t is not None]
    assert len({tuple(step) for step in expected}) > 1  # the draws do vary


# --- the draw: one uniform per unseeded row, through the inverse CDF ----------------------------

def stratified_counts(logits: torch.Tensor, draws: int, ops) -> torch.Tensor:
    """How often each token is drawn when the uniforms are an even grid over [0, 1): the inverse
    CDF then draws each token its probability's share of the grid, to within a draw."""
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    tokens = torch.cat([ops.draw_rows(logits.expand(len(chunk), -1).contiguous(), chunk)
                        for chunk in uniforms.split(1024)])
    return torch.bincount(tokens, minlength=logits.shape[-1])


@pytest.mark.parametrize("vocab,spread", [(10, 1.0), (1000, 1.0), (8192, 0.3)])
def test_draws_follow_the_probabilities(vocab, spread, ops):
    """Peaked to flat rows, some tokens masked: each token's share of an even grid of uniforms is
    its softmax probability times the grid, within two draws (the masses are float32)."""
    logits = model_like_logits(1, vocab, spread, seed=vocab)
    logits[0, ::7] = float("-inf")
    draws = 10000
    counts = stratified_counts(logits, draws, ops)
    expected = torch.softmax(logits[0].double(), dim=-1) * draws
    assert int(counts.sum()) == draws
    assert float((counts - expected).abs().max()) <= 2.0
    assert int(counts[::7].sum()) == 0


def test_draws_never_take_a_masked_token(ops):
    """Uniforms at 0 and at the largest double under 1; one finite token (first, last, middle);
    a row with none or with a NaN draws token 0."""
    top = 1.0 - 2.0 ** -53
    logits = torch.full((6, 300), float("-inf"))
    logits[0, 0] = logits[1, 299] = logits[2, 150] = 3.0
    logits[3, 290:] = torch.linspace(-5, 5, 10)  # the best and the rest at the very end
    logits[5, 7] = float("nan")
    for uniform in (0.0, 0.5, top):
        tokens = ops.draw_rows(logits, torch.full((6,), uniform, dtype=torch.float64)).tolist()
        assert tokens[:3] == [0, 299, 150] and tokens[4:] == [0, 0]
        assert 290 <= tokens[3] <= 299
    assert ops.draw_rows(logits[3:4], torch.tensor([top], dtype=torch.float64)).item() == 299


def test_unseeded_rows_draw_from_the_sampler_generator(ops):
    """The same sampler seed gives the same unseeded draws, another seed others."""
    logits = model_like_logits(4, 49152, 0.5, seed=3)
    rows = [row(temperature=0.8, top_p=0.95) for _ in range(4)]
    draws = [Sampler(seed=seed, ops=ops)(logits, rows).token_ids for seed in (5, 5, 6)]
    assert draws[0] == draws[1] != draws[2]

