"""Attention sinks (StreamingLLM, `--streaming-window`): the scheduler's policy keeps the sink
blocks and a sliding window in bounded memory, only sinks are shared, the workers' cache is the
sinks then the window at cache positions (keys rotated back on eviction), and until the first
eviction the tokens are the plain engine's. Perplexity over a 22k-token stream:
benchmarks/streaming_perplexity.py."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.kv_cache.spec import KVCacheGroup, StreamingSpec, streaming_spec
from kvserve.protocol.worker import NULL_BLOCK_ID
from tests.helpers import bounded, make_request

BS = 4


def _manager(spec: StreamingSpec, num_blocks: int = 64, caching: bool = True):
    return KVCacheManager(num_blocks, BS, caching, (KVCacheGroup(spec, (0, 1)),))


def test_streaming_spec_from_flags():
    """Sinks round up to whole blocks; the window slides a quarter at a time."""
    assert streaming_spec(16, 1024, 1) == StreamingSpec(16, 1, 1024, 16)
    assert streaming_spec(16, 40, 0).evict_blocks == 1
    assert StreamingSpec(16, 1, 1024, 16).max_cached_tokens(256) == (1 + 65 + 15 + 16) * 16
    with pytest.raises(ValueError, match="streaming"):
        StreamingSpec(16, 0, 0, 1)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_window_slides_in_steps_and_memory_stays_bounded(chunk):
    """A 300-token stream in steps of `chunk`: the sink block is never released, the evicted
    positions are one run right after it, released `evict_blocks` at a time, every query
    still sees the last window - 1 keys, and the blocks held never pass the spec's bound."""
    spec = StreamingSpec(BS, sink_blocks=1, window=16, evict_blocks=2)
    kv = _manager(spec)
    request = make_request("r", list(range(300)))
    bound = spec.max_cached_tokens(chunk) // BS
    evicted_counts = {0}
    while request.num_computed_tokens < request.num_tokens:
        count = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, count)
        table = kv.block_ids("r")
        nulls = [i for i, block in enumerate(table) if block == NULL_BLOCK_ID]
        assert table[0] != NULL_BLOCK_ID
        assert nulls == list(range(1, 1 + len(nulls)))  # one run after the sink
        query = request.num_computed_tokens
        assert (1 + len(nulls)) * BS <= max(BS, query - spec.window + 1)  # window intact
        assert kv.num_held_blocks("r") <= bound
        evicted_counts.add(len(nulls))
        request.num_computed_tokens += count
        kv.release_unneeded(request)
    counts = sorted(evicted_counts)
    assert counts[-1] >= 60 and min(b - a for a, b in zip(counts, counts[1:])) >= 2
    kv.free(request)
    assert kv.pool.num_used_blocks == 0


def test_only_sink_blocks_are_shared_through_the_prefix_cache():
    """The window's keys are rotated in place, so a second request with the same 100-token
    prompt hits the sink block alone, whatever the first one left cached."""
    spec = StreamingSpec(BS, sink_blocks=2, window=16, evict_blocks=1)
    kv = _manager(spec)
    first = make_request("a", list(range(100)))
    for _ in bounded(200):
        if first.num_computed_tokens == first.num_tokens:
            break
        assert kv.allocate_slots(first, 4)
        first.num_computed_tokens += 4
        kv.cache_computed_blocks(first)
        kv.release_unneeded(first)
    cached = {block.block_id for block in kv.pool.cached.values()}
    assert cached == set(kv.block_ids("a")[:2])
    kv.free(first)
    blocks, hit = kv.get_computed_blocks(make_request("b", list(range(100))))
    assert hit == 2 * BS and len(blocks[0]) == 2


@pytest.mark.parametrize("overrides", [{}, {"partial_rotary_factor": 0.5},
                                       {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 512}}],
                         ids=["plain", "partial-rotary", "yarn"])
def test_shifted_keys_equal_keys_written_at_the_shifted_positions(overrides):
    """Keys written at positions p + 37 and rotated back by 37 equal the keys of the same
    tokens written at p, in every layer (the same tokens at shifted positions see the same
    relative positions, so only RoPE differs); values are untouched."""
    from kvserve.attention import build_attention_metadata
    from kvserve.attention.kv_tensors import allocate_kv_caches
    from kvserve.models import random_model
    from kvserve.testing.tiny import tiny_config

    model = random_model(tiny_config(**overrides), "float32", seed=0)
    caches = allocate_kv_caches(model.kv_page_layouts(torch.float32), 8, 16)
    model.bind_kv_cache(caches)
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0))
    for table, offset in (([0, 1, 2], 37), ([4, 5, 6], 0)):
        metadata, positions = build_attention_metadata([40], [40], [table], 16)
        model(ids, positions + offset, metadata)
    model.shift_keys([0, 1, 2], -37)
    for cache in caches:
        shifted, written = cache[:, [0, 1, 2]].flatten(1, 2)[:, :40], \
            cache[:, [4, 5, 6]].flatten(1, 2)[:, :40]
        torch.testing.assert_close(shifted[0], written[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(shifted[1], written[1], atol=2e-5, rtol=1e-4)


def _layer0_keys(model, token_ids: list[int]) -> torch.Tensor:
    """Layer 0's keys of `token_ids` at positions 0.. (they depend on nothing else)."""
    from kvserve.models.paged_loop import PagedLoop

    loop = PagedLoop(model, 1, len(token_ids))
    loop.step([token_ids], [len(token_ids)], [0])
    table = loop.block_tables[0]
    keys = model.model.stage_layers[0].self_attn.kv_cache[0]
    return keys[table].flatten(0, 1)[:len(token_ids)].clone()


@pytest.mark.slow
def test_engine_holds_sinks_then_window_at_cache_positions(smollm_source):
    """SmolLM2 streaming a 200-token prompt plus 40 tokens with a 48-token window: its KV never
    passes the bound, and after every step the workers' cache is exactly the sink block then
    the window's tokens, layer 0's keys equal to those of a fresh prefill of those tokens at
    positions 0.. (compaction, positions within the cache and the rotation on eviction)."""
    from kvserve import LLM, SamplingParams
    from kvserve.models import load_model

    llm = LLM(dtype="float32", streaming_window=48, streaming_sink_tokens=4, block_size=16,
              max_num_batched_tokens=32, enable_prefix_caching=False, engine_core="thread")
    engine = llm.llm_engine
    core = engine.engine_core
    kv, runner = core.kv_manager, core.runner
    bound = core.scheduler.kv.groups[0].spec.max_cached_tokens(32) // 16
    reference, _ = load_model(smollm_source, "float32", attention_backend="paged")
    prompt = list(range(1000, 1200))
    engine.add_request("s", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    request, state = core.scheduler.requests["s"], None
    checked_evicted = set()
    for _ in bounded(100, "the stream"):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if request.is_finished:
            continue
        assert kv.num_held_blocks("s") <= bound
        state = core.executor.worker.requests["s"]
        cache = [block for block in state.block_ids if block != NULL_BLOCK_ID]
        tokens = request.all_token_ids
        held = tokens[:16] + tokens[16 + state.kv_shift:request.num_computed_tokens]
        slots = [cache[i // 16] * 16 + i % 16 for i in range(len(held))]
        keys = runner.kv_caches[0][0].flatten(0, 1)[slots]
        torch.testing.assert_close(keys, _layer0_keys(reference, held), atol=1e-4, rtol=1e-4)
        checked_evicted.add(state.kv_shift)
    assert len(checked_evicted) >= 3  # several evictions, each checked after its shift


@pytest.mark.slow
def test_engine_tokens_equal_the_plain_engine_until_the_first_eviction():
    """Within the window nothing is evicted, so streaming changes no token (float32)."""
    from kvserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(500, 500 + n))} for n in (30, 150)]
    tokens = []
    for extra in ({}, {"streaming_window": 256, "max_num_batched_tokens": 64}):
        llm = LLM(dtype="float32", engine_core="thread", **extra)
        tokens.append([out.outputs[0].token_ids for out in llm.generate(prompts, params)])
    assert tokens[0] == tokens[1]


def test_streaming_refuses_what_it_cannot_serve(tiny_model_dir):
    """Models with windows of their own, KV transfer, and a cache bound past the model's
    context are refused at start-up with the reason."""
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine_config import EngineConfig

    base = dict(model=str(tiny_model_dir), dtype="float32", engine_core="thread",
                streaming_window=64)
    with pytest.raises(ValueError, match="KV transfer"):
        LLMEngine(EngineConfig(**base, kv_role="prefill"))
    with pytest.raises(ValueError, match="more positions than the model's context"):
        LLMEngine(EngineConfig(**{**base, "streaming_window": 4000}))
    with pytest.raises(ValueError, match="streaming-window must be"):
        EngineConfig(**{**base, "streaming_window": 0})
