"""The model over the paged cache on the tiny random model: chunking, block sizes, dtypes."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import build_attention_metadata
from kvserve.models import random_model
from kvserve.models.paged_loop import PagedLoop
from kvserve.testing.tiny import tiny_config

PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(45)]


def _full_prefill(model, ids, block_size=16):
    return PagedLoop(model, 1, 64, block_size).step([ids], [len(ids)], [0], all_logits=True)[0]


def test_chunked_prefill_equals_one_shot(tiny_model):
    reference = _full_prefill(tiny_model, PROMPT)
    loop = PagedLoop(tiny_model, 1, 64)
    pieces, done = [], 0
    for size in (7, 1, 16, 21):
        chunk = PROMPT[done: done + size]
        done += len(chunk)
        pieces.append(loop.step([chunk], [done], [0], all_logits=True)[0])
    assert torch.allclose(torch.cat(pieces), reference, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_block_size_does_not_change_results(tiny_model, block_size):
    reference = _full_prefill(tiny_model, PROMPT)
    assert torch.allclose(_full_prefill(tiny_model, PROMPT, block_size), reference, atol=1e-5)


def test_mixed_prefill_and_decode_batch(tiny_model):
    """One batch holding a decode of sequence 0 and a prefill chunk of sequence 1."""
    loop = PagedLoop(tiny_model, 2, 64)
    first = loop.step([PROMPT[:10]], [10], [0])[0]
    token = int(first.argmax())
    mixed = loop.step([[token], PROMPT[:20]], [11, 20], [0, 1])
    alone_0 = PagedLoop(tiny_model, 1, 64).step([PROMPT[:10] + [token]], [11], [0])[0]
    alone_1 = PagedLoop(tiny_model, 1, 64).step([PROMPT[:20]], [20], [0])[0]
    assert torch.allclose(mixed[0], alone_0, atol=1e-5)
    assert torch.allclose(mixed[1], alone_1, atol=1e-5)


def test_bfloat16_close_to_float32():
    fp32 = random_model(tiny_config(), "float32", seed=1)
    bf16 = random_model(tiny_config(), "bfloat16", seed=1)
    assert next(bf16.parameters()).dtype == torch.bfloat16
    a, b = _full_prefill(fp32, PROMPT), _full_prefill(bf16, PROMPT)
    assert b.dtype == torch.float32  # logits are always float32
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()


def test_slot_mapping_and_positions():
    metadata, positions = build_attention_metadata(
        query_lens=[3, 1], seq_lens=[3, 6], block_tables=[[5], [2, 9]], block_size=4)
    assert positions.tolist() == [0, 1, 2, 5]
    assert metadata.slot_mapping.tolist() == [20, 21, 22, 9 * 4 + 1]
    assert metadata.query_start_loc_host == [0, 3, 4]
    assert metadata.max_query_len == 3 and metadata.max_seq_len == 6


def test_unknown_attention_backend():
    with pytest.raises(ValueError, match="torch_ref"):
        random_model(tiny_config(), attention_backend="nope")


def _mixed_batch_delta(backend: str, cpu_kernels: bool, dtype: str) -> float:
    """Mixed batches: fresh prompts short and long (past the paged kernel's query limit), chunks
    on top of cached context short and long, and decodes; the largest difference of any
    position's logits from the torch_ref backend's, relative to their scale (at least 1)."""
    reference = random_model(tiny_config(), dtype, seed=2, attention_backend="torch_ref")
    fast = random_model(tiny_config(), dtype, seed=2, attention_backend=backend,
                        use_cpu_kernels=cpu_kernels)
    results = []
    for model in (reference, fast):
        loop = PagedLoop(model, 5, 64, block_size=4)
        loop.step([PROMPT[:10], PROMPT[:7], PROMPT[:13], PROMPT[:30]], [10, 7, 13, 30],
                  [0, 1, 2, 3])
        mixed = loop.step([[5], PROMPT[7:20], [9], PROMPT[30:45], PROMPT[:40]],
                          [11, 20, 14, 45, 40], [0, 1, 2, 3, 4], all_logits=True)
        long_chunk = loop.step([PROMPT[20:45], [4]], [45, 41], [1, 4], all_logits=True)
        decode = loop.step([[6], [7], [8], [9]], [12, 46, 15, 46], [0, 1, 2, 3],
                           all_logits=True)
        results.append(torch.cat(mixed + long_chunk + decode))
    scale = results[0].abs().max().item()
    return (results[0] - results[1]).abs().max().item() / max(1.0, scale)


DTYPES = [("float32", 1e-5), ("bfloat16", 0.05)]
FAST_BACKENDS = [("sdpa_batched", True), ("paged", True), ("paged", False)]


@pytest.mark.parametrize("backend,cpu_kernels", [("sdpa_batched", True), ("paged", False)])
@pytest.mark.parametrize("dtype,tolerance", DTYPES)
def test_fast_backends_match_reference(backend, cpu_kernels, dtype, tolerance):
    assert _mixed_batch_delta(backend, cpu_kernels, dtype) <= tolerance


@pytest.mark.parametrize("dtype,tolerance", DTYPES)
def test_paged_kernels_match_reference_at_every_level(isa_level, dtype, tolerance):
    assert _mixed_batch_delta("paged", True, dtype) <= tolerance


def test_flash_path_in_bfloat16_matches_reference(isa_level):
    """head_dim 64 in bfloat16: prompts and chunks of 4 or more tokens take the flash kernel
    (where the level has it), next to paged-kernel decodes and 2-token chunks."""
    config = tiny_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64)
    long_prompt = [(7 * i + 3) % 900 + 10 for i in range(200)]
    reference = random_model(config, "bfloat16", seed=5, attention_backend="torch_ref")
    fast = random_model(config, "bfloat16", seed=5, attention_backend="paged")
    results = []
    for model in (reference, fast):
        loop = PagedLoop(model, 3, 224, block_size=16)
        loop.step([long_prompt[:90], long_prompt[:5]], [90, 5], [0, 1], all_logits=True)
        results.append(torch.cat(loop.step(
            [long_prompt[90:200], long_prompt[5:30], long_prompt[:20]], [200, 30, 20],
            [0, 1, 2], all_logits=True)))
        results.append(torch.cat(loop.step([[4], [5, 6]], [201, 32], [0, 1], all_logits=True)))
    scale = results[0].abs().max().item()
    for expected, actual in zip(results[:2], results[2:]):
        assert (expected - actual).abs().max().item() <= 0.05 * max(1.0, scale)


@pytest.mark.parametrize("dtype,tolerance", DTYPES)
def test_paged_backend_long_chunks_match_reference(isa_level, dtype, tolerance):
    """Past the paged kernel's query limit: a 150-token chunk over 60 cached tokens (gathered
    path) and a 140-token fresh prompt (SDPA), next to a 100-token chunk (paged kernel)."""
    long_prompt = [(11 * i + 5) % 900 + 10 for i in range(210)]
    reference = random_model(tiny_config(), dtype, seed=4, attention_backend="torch_ref")
    fast = random_model(tiny_config(), dtype, seed=4, attention_backend="paged")
    results = []
    for model in (reference, fast):
        loop = PagedLoop(model, 3, 224, block_size=16)
        loop.step([long_prompt[:60], long_prompt[:40]], [60, 40], [0, 1])
        results.append(torch.cat(loop.step(
            [long_prompt[60:210], long_prompt[40:140], long_prompt[:140]], [210, 140, 140],
            [0, 1, 2], all_logits=True)))
    scale = results[0].abs().max().item()
    assert (results[0] - results[1]).abs().max().item() <= tolerance * max(1.0, scale)


# windows of 11 and 40 keys (neither a multiple of the block sizes) on layers 0 and 2, layer 1 full
WINDOWED = dict(vocab_size=1000, num_hidden_layers=3)
# head_dim 64 in bfloat16: the flash and bf16 decode kernels where the CPU has AVX512-BF16
WINDOW_CASES = [("float32", 1e-5, 16, 4), ("float32", 1e-5, 16, 16), ("bfloat16", 0.05, 16, 4),
                ("bfloat16", 0.05, 64, 16)]


@pytest.mark.parametrize("backend,cpu_kernels", FAST_BACKENDS)
@pytest.mark.parametrize("dtype,tolerance,head_dim,block_size", WINDOW_CASES)
def test_fast_backends_match_reference_with_sliding_windows(backend, cpu_kernels, dtype,
                                                            tolerance, head_dim, block_size):
    """Every path a windowed layer can take, contexts far past the windows: a fresh prompt past
    the paged kernel's query limit (banded SDPA), chunks over cached context short (paged
    kernel, or flash in bf16) and long (gathered SDPA), decodes, a fresh prompt shorter than a
    window; every position's logits."""
    shape = dict(WINDOWED, hidden_size=4 * head_dim, head_dim=head_dim)
    config = tiny_config(**shape, sliding_windows=(11, None, 40))
    long_prompt = [(11 * i + 5) % 900 + 10 for i in range(230)]
    reference = random_model(config, dtype, seed=6, attention_backend="torch_ref")
    fast = random_model(config, dtype, seed=6, attention_backend=backend,
                        use_cpu_kernels=cpu_kernels)
    full = random_model(tiny_config(**shape), dtype, seed=6, attention_backend="torch_ref")
    results = []
    for model in (reference, fast, full):
        loop = PagedLoop(model, 4, 240, block_size=block_size)
        steps = [loop.step([long_prompt[:60], long_prompt[:150], long_prompt[:9]], [60, 150, 9],
                           [0, 1, 2], all_logits=True)]
        steps.append(loop.step([long_prompt[60:210], long_prompt[150:170], [5],
                                long_prompt[:30]], [210, 170, 10, 30], [0, 1, 2, 3],
                               all_logits=True))
        steps.append(loop.step([[4], [5], long_prompt[10:50], [6]], [211, 171, 50, 31],
                               [0, 1, 2, 3], all_logits=True))
        results.append(torch.cat([logits for step in steps for logits in step]))
    scale = results[0].abs().max().item()
    assert (results[0] - results[1]).abs().max().item() <= tolerance * max(1.0, scale)
    assert (results[0] - results[2]).abs().max().item() > 0.1 * scale  # the windows matter
