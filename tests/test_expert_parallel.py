"""Expert parallelism (models/layers/expert_parallel.py, expert_placement.py): a mixture's
experts split whole over the tensor-parallel ranks while attention stays split by heads, with
EPLB's redundant copies and a rebalance mid-run; ranks in spawned processes (gloo, the
shared-memory all-reduce) against one process: float32 logits within 1e-4, equal greedy
tokens."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from kvserve.errors import UnsupportedArchitectureError
from kvserve.models.layers.expert_placement import ExpertPlacement, rebalanced
from kvserve.testing.rank_pool import RankError, RankPool
from tests.helpers import TP_CONFIGS as CONFIGS
from tests.helpers import TP_VOCAB as VOCAB
from tests.helpers import deepseek_ep_config, ragged_run

transformers = pytest.importorskip("transformers")


def _qwen2_moe(world_size: int):
    """Qwen2-MoE: 6 experts, a gated shared expert, a dense layer (the fused C++ layer in one
    process; the Python loop over a rank's experts)."""
    return transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, **CONFIGS[world_size], num_hidden_layers=3, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
        mlp_only_layers=[1], norm_topk_prob=True, initializer_range=0.2)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"ep{n}")
def pool(request):
    with RankPool(request.param, timeout_s=60) as ranks:
        yield ranks


def _expert_parallel_run(contexts, directory, redundant=0, rebalance_after=0):
    """On every rank: the model with its experts (and `redundant` extra copies), the ragged
    run, EPLB's rebalance after step `rebalance_after` (0: none). Returns the run and the
    experts this rank held before and after."""
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model

    parallel = dataclasses.replace(contexts["shm"], expert_parallel=True,
                                   redundant_experts=redundant)
    model, _ = load_model(resolve_model(directory), "float32", attention_backend="paged",
                          parallel=parallel)
    moe = next(m for m in model.modules() if getattr(m, "ep", None) is not None)
    before = sorted(moe.ep.placement.experts_of(moe.ep.rank))
    moved = []

    def between(step):
        if step == rebalance_after:
            moved.append(model.rebalance_experts())

    tokens, logits = ragged_run(model, between_steps=between)
    after = sorted(moe.ep.placement.experts_of(moe.ep.rank))
    if moved:
        balance_before, balance_after = moe.ep.balancedness
        assert balance_after >= balance_before
    return tokens, logits, before, after, moved


def _one_process(directory):
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model

    model, _ = load_model(resolve_model(directory), "float32", attention_backend="paged")
    return ragged_run(model)


def _check(pool, directory, redundant=0, rebalance_after=0):
    expected_tokens, expected_logits = _one_process(directory)
    results = pool.run(_expert_parallel_run, str(directory), redundant, rebalance_after)
    for tokens, logits, *_ in results:
        assert (logits - expected_logits).abs().max().item() < 1e-4
        assert tokens == expected_tokens
    return results


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_expert_parallel_matches_one_process(pool, tmp_path, tokenizer, family):
    """Each rank holds whole experts (none twice, all of them once between the ranks); the
    routed tokens each rank's copies compute, summed by the one all-reduce, give one
    process's numbers. DeepSeek's 8 experts over 3 ranks take one redundant copy."""
    from tests.helpers import save_hf_checkpoint

    config = (deepseek_ep_config if family == "deepseek_v3" else _qwen2_moe)(pool.world_size)
    save_hf_checkpoint(config, tmp_path, tokenizer)
    experts = getattr(config, "n_routed_experts", None) or config.num_experts
    redundant = (-experts) % pool.world_size
    results = _check(pool, tmp_path, redundant=redundant)
    held = [before for *_, before, _, _ in results]
    assert sorted(e for rank in held for e in rank) == sorted(
        list(range(experts)) + list(range(redundant)))
    assert all(len(rank) == (experts + redundant) // pool.world_size for rank in held)


def test_eplb_rebalances_mid_run_without_changing_outputs(pool, tmp_path, tokenizer):
    """Two redundant copies, a rebalance after the second step from the load measured so far:
    copies move between ranks (point to point), and the run still gives one process's
    logits and tokens."""
    from tests.helpers import save_hf_checkpoint

    save_hf_checkpoint(deepseek_ep_config(pool.world_size), tmp_path, tokenizer)
    redundant = 2 if pool.world_size == 2 else 4
    results = _check(pool, tmp_path, redundant=redundant, rebalance_after=2)
    assert any(before != after for *_, before, after, _ in results)
    assert all(moved == [2] for *_, moved in results)  # both mixture layers re-placed


def test_an_expert_parallel_size_that_does_not_divide_is_named(pool, tmp_path, tokenizer):
    from tests.helpers import save_hf_checkpoint

    config = _qwen2_moe(pool.world_size)
    config.num_experts = 5 if pool.world_size == 2 else 8
    save_hf_checkpoint(config, tmp_path, tokenizer)
    with pytest.raises(RankError, match=f"expert-parallel size {pool.world_size} does not "
                                        f"divide the model's {config.num_experts} experts"):
        pool.run(_expert_parallel_run, str(tmp_path))


def test_initial_placement_runs_contiguously():
    assert ExpertPlacement.initial(8, 2).physical == (0, 1, 2, 3, 4, 5, 6, 7)
    placement = ExpertPlacement.initial(8, 2, redundant=2)
    assert placement.experts_of(0) == {0, 1, 2, 3, 4} and placement.experts_of(1) == {0, 1, 5,
                                                                                      6, 7}
    with pytest.raises(UnsupportedArchitectureError, match="size 3 does not divide"):
        ExpertPlacement.initial(8, 3)


def test_rebalancing_copies_the_busiest_and_evens_the_ranks():
    """The hottest experts get the redundant copies; no rank holds an expert twice and every
    expert has a copy, for many random loads."""
    load = [100.0, 5, 5, 5, 5, 5, 5, 70]
    placement = rebalanced(load, 2, 2)
    assert placement.holders(0) == [0, 1] and placement.holders(7) == [0, 1]
    generator = random.Random(0)
    for _ in range(300):
        ranks = generator.choice([2, 3, 4])
        experts = ranks * generator.randint(1, 5)
        redundant = min(ranks * generator.randint(0, 2), experts * (ranks - 1))
        load = [generator.expovariate(1.0) * 100 for _ in range(experts)]
        placement = rebalanced(load, ranks, redundant)
        for rank in range(ranks):
            held = placement.physical[rank * placement.slots:(rank + 1) * placement.slots]
            assert len(set(held)) == len(held)
        assert sorted(set(placement.physical)) == list(range(experts))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_engine_serves_with_expert_parallel_and_eplb(tmp_path, tokenizer, capfd,
                                                          mixed_workload_reference):
    """`LLM(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
    eplb_config={"step_interval": 4, "num_redundant_experts": 2})` on the mp executor: the
    mixed workload (preemptions included) gives one process's tokens and logprobs while the
    workers re-place their experts every 4 steps."""
    import logging

    from kvserve import LLM
    from tests.helpers import run_mixed_workload, save_hf_checkpoint, small_pool_options

    logging.getLogger().setLevel(logging.INFO)  # the workers log at the engine's level
    save_hf_checkpoint(deepseek_ep_config(2, 49152), tmp_path, tokenizer)
    expected, expected_logprobs, _ = mixed_workload_reference(tmp_path)
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="mp",
              enable_expert_parallel=True, enable_eplb=True,
              eplb_config={"step_interval": 4, "num_redundant_experts": 2,
                           "log_balancedness": True}, **small_pool_options())
    try:
        tokens, logprobs = run_mixed_workload(llm)
        assert tokens == expected
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-4
    finally:
        llm.shutdown()
    logs = capfd.readouterr().err
    for rank in (0, 1):  # every rank re-placed its experts at the same steps
        for step in (4, 8):
            assert re.search(rf"\[worker {rank}\] \S+: EPLB at step {step}: \d mixture layers",
                             logs)
    assert "EPLB balancedness" in logs


@pytest.mark.parametrize("options, named", [
    ({"enable_eplb": True}, "--enable-eplb needs --enable-expert-parallel"),
    ({"enable_expert_parallel": True, "eplb_config": {"num_redundant_experts": 2}},
     "num_redundant_experts needs --enable-eplb"),
    ({"enable_expert_parallel": True, "enable_eplb": True,
      "eplb_config": {"window_size": 10}}, "window_size 10 differs"),
    ({"enable_expert_parallel": True, "enable_eplb": True,
      "eplb_config": {"rebalance_algorithm": "x"}}, "'rebalance_algorithm' not implemented"),
])
def test_eplb_options_are_checked_at_start(options, named):
    from kvserve.engine_config import EngineConfig

    with pytest.raises(ValueError, match=named):
        EngineConfig(**options)
