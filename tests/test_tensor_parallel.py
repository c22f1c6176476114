"""Tensor parallelism: ranks in spawned processes (gloo, both all-reduces) against one process.

Each check runs a ragged batch (whole prompts, chunked prompts finishing beside decodes, then
greedy decodes of 16 sequences) on the sharded model and on the same model unsharded: float32
logits within 1e-4 and equal greedy tokens, on the paged backend (compiled kernels) and torch_ref,
unquantized and int8 (int4 and w8a8 in one case each). One pool of ranks per world size serves
the whole module.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from kvserve.attention.kv_tensors import kv_bytes_per_block
from kvserve.distributed.communication import Communicator
from kvserve.distributed.parallel_state import ParallelContext
from kvserve.distributed.sharding import (
    kv_head_range,
    shard_config,
    validate_tensor_parallel,
    vocab_range,
)
from kvserve.models import random_model
from kvserve.testing.rank_pool import RankError, RankPool
from kvserve.testing.tiny import tiny_config
from tests.helpers import TP_CONFIGS as CONFIGS
from tests.helpers import TP_PROMPT_ROWS as PROMPT_ROWS
from tests.helpers import TP_VOCAB as VOCAB
from tests.helpers import ragged_run

# more ranks than KV heads: each rank holds a copy of the one its query heads read
REPLICATED_KV = {
    2: dict(num_attention_heads=4, num_key_value_heads=1, hidden_size=64, intermediate_size=128),
    3: dict(num_attention_heads=6, num_key_value_heads=1, hidden_size=96, intermediate_size=192),
}


def _model(config_fields, backend, quantization, parallel=None, dtype="float32"):
    return random_model(tiny_config(vocab_size=VOCAB, **config_fields), dtype, seed=5,
                        attention_backend=backend, quantization=quantization, parallel=parallel)


@functools.lru_cache(maxsize=None)
def single_process(config_key, backend, quantization, dtype="float32"):
    return ragged_run(_model(json.loads(config_key), backend, quantization, dtype=dtype))


def sharded_run(contexts, all_reduce, config_fields, backend, quantization, dtype="float32"):
    """On every rank: its shard, the same ragged run; the KV cache holds only its KV heads."""
    parallel = contexts[all_reduce]
    model = _model(config_fields, backend, quantization, parallel, dtype)
    full = tiny_config(vocab_size=VOCAB, **config_fields)
    kv_heads = max(1, full.num_key_value_heads // parallel.tp_size)
    assert model.config.num_key_value_heads == kv_heads
    assert kv_bytes_per_block(model.config, 16, torch.float32) == \
        kv_bytes_per_block(full, 16, torch.float32) * kv_heads // full.num_key_value_heads
    return ragged_run(model)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"tp{n}")
def pool(request):
    with RankPool(request.param, timeout_s=60) as ranks:
        yield ranks


def _check(pool, config_fields, backend, quantization, all_reduce, atol=1e-4):
    expected_tokens, expected_logits = single_process(json.dumps(config_fields), backend,
                                                      quantization)
    results = pool.run(sharded_run, all_reduce, config_fields, backend, quantization)
    for tokens, logits in results:  # every rank gathers the same logits
        assert (logits - expected_logits).abs().max().item() < atol
        assert tokens == expected_tokens


@pytest.mark.parametrize("all_reduce", ["shm", "torch"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("backend", ["paged", "torch_ref"])
def test_sharded_model_matches_one_process(pool, backend, quantization, all_reduce):
    _check(pool, CONFIGS[pool.world_size], backend, quantization, all_reduce)


def test_replicated_kv_heads_match_one_process(pool):
    _check(pool, REPLICATED_KV[pool.world_size], "paged", "none", "shm")


def test_qk_norm_shards_match_one_process(pool):
    """Qwen3's QK-norm: its weights (one head's width) are replicated and each rank normalises
    its own heads, so the shards still equal one process."""
    _check(pool, dict(CONFIGS[pool.world_size], architecture="qwen3", qk_norm=True), "paged",
           "none", "shm")


def _hf_checkpoint_shards_match_one_process(pool, directory, hf_config, tokenizer):
    """A checkpoint saved by HF transformers for `hf_config`, each rank loading its slices of
    the directory: the one-process model's logits (within 1e-4) and greedy tokens."""
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model
    from tests.helpers import save_hf_checkpoint

    save_hf_checkpoint(hf_config, directory, tokenizer)
    whole, _ = load_model(resolve_model(directory), "float32", attention_backend="paged")
    expected_tokens, expected_logits = ragged_run(whole)
    for tokens, logits in pool.run(_load_sharded, str(directory), "paged"):
        assert (logits - expected_logits).abs().max().item() < 1e-4
        assert tokens == expected_tokens


def test_gemma3_checkpoint_shards_match_one_process(pool, tmp_path, tokenizer):
    """Gemma 3: its extra norms (sandwich, QK-norm, all (1 + w), drawn at random) replicated on
    every rank, the scaled embedding on the vocabulary shards, local and global RoPE tables,
    windows the prompts cross."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, **CONFIGS[pool.world_size], head_dim=32, num_hidden_layers=3,
        sliding_window=16, query_pre_attn_scalar=24, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    _hf_checkpoint_shards_match_one_process(pool, tmp_path / "gemma3", config, tokenizer)


def test_phi3_checkpoint_shards_match_one_process(pool, tmp_path, tokenizer):
    """Phi-3 / Phi-4-mini: the checkpoint's fused qkv_proj and gate_up_proj split by their q/k/v
    and gate/up parts before each rank takes its heads and rows (the layers' own rules), Q/K
    rows reordered per head for partial rotary, LongRoPE past its 32-position pretraining
    context, a window on every layer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(
        vocab_size=VOCAB, **CONFIGS[pool.world_size], num_hidden_layers=2,
        max_position_embeddings=256, original_max_position_embeddings=32, sliding_window=16,
        initializer_range=0.2, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]})
    _hf_checkpoint_shards_match_one_process(pool, tmp_path / "phi3", config, tokenizer)


def test_mixture_of_experts_shards_match_one_process(pool, tmp_path, tokenizer):
    """Qwen2-MoE: each expert's (and the shared expert's) intermediate dimension split over
    the ranks, the replicated router and shared-expert gate, one all-reduce of the routed and
    shared sum; a dense layer beside the sparse ones."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, **CONFIGS[pool.world_size], num_hidden_layers=3, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
        mlp_only_layers=[1], norm_topk_prob=True, initializer_range=0.2)
    _hf_checkpoint_shards_match_one_process(pool, tmp_path / "qwen2_moe", config, tokenizer)


def test_gpt_oss_shards_match_one_process(pool, tmp_path, tokenizer):
    """gpt-oss: each rank's heads' sinks, the output projection's and each expert's down
    projection's bias added by one rank (their partial sums are all-reduced), the experts'
    stacked, interleaved checkpoint tensors split per expert before each rank takes its rows,
    the biased router replicated, sliding and full layers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, **CONFIGS[pool.world_size], num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention"])
    _hf_checkpoint_shards_match_one_process(pool, tmp_path / "gpt_oss", config, tokenizer)


def test_deepseek_shards_match_one_process(pool, tmp_path, tokenizer):
    """DeepSeek-V3: latent attention with q LoRA split by heads (q_b_proj's rows, kv_b_proj's
    rows, o_proj's columns) while every rank keeps the whole latent in its cache; group-limited
    sigmoid routing replicated, each expert's and the shared expert's intermediate split; a
    dense first layer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, **CONFIGS[pool.world_size], num_hidden_layers=3,
        moe_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        initializer_range=0.2)
    _hf_checkpoint_shards_match_one_process(pool, tmp_path / "deepseek_v3", config, tokenizer)


def test_an_fp8_checkpoint_shards_match_one_process(pool, tmp_path, tokenizer):
    """DeepSeek-V3 as a block-scaled fp8 checkpoint in fp8 mode: every rank converts whole
    tensors to the same Q8_0 blocks (quant/fp8.py) and takes its rows and columns of them.
    Not bit-equal to one process: the integer-dot kernels round each rank's activations to
    int8, and a sum in another order can flip a code (0.008 seen); so, as w8a8's, compared on
    the prompt rows, within twice one process's distance from the exact fp8 values."""
    transformers = pytest.importorskip("transformers")
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model
    from tests.helpers import save_hf_checkpoint, write_fp8_checkpoint

    fields = CONFIGS[pool.world_size]
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, **fields, num_hidden_layers=3, moe_intermediate_size=32 * pool.world_size,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, initializer_range=0.05)
    save_hf_checkpoint(config, tmp_path / "float", tokenizer)
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", (8, 32))
    source = resolve_model(tmp_path / "fp8")
    _, exact = ragged_run(load_model(source, "float32", attention_backend="paged")[0])
    _, one_process = ragged_run(load_model(source, "float32", attention_backend="paged",
                                           quantization="fp8")[0])
    own_noise = (one_process - exact)[PROMPT_ROWS].abs().max().item()
    for _, logits in pool.run(_load_sharded, str(tmp_path / "fp8"), "paged", "fp8"):
        assert (logits - exact)[PROMPT_ROWS].abs().max().item() < 2 * own_noise


def test_sdpa_batched_backend_matches_one_process(pool):
    _check(pool, CONFIGS[pool.world_size], "sdpa_batched", "none", "shm")


def test_bfloat16_shards_stay_within_rounding(pool):
    """bf16 (our bf16 GEMV panels, flash attention): partial sums rounded per rank, so close to
    one process rather than equal; compared on the prompt rows (no greedy feedback)."""
    fields = CONFIGS[pool.world_size]
    prompt_rows = PROMPT_ROWS
    _, expected = single_process(json.dumps(fields), "paged", "none", "bfloat16")
    for _, logits in pool.run(sharded_run, "shm", fields, "paged", "none", "bfloat16"):
        error = (logits - expected)[prompt_rows].abs().max().item()
        assert error < 0.05 * expected.abs().max().item()


def test_int4_shards_along_groups(pool):
    """Row-parallel slices cut at group boundaries keep the whole matrix's codes and scales."""
    _check(pool, CONFIGS[pool.world_size], "paged", "int4", "shm")


def test_w8a8_within_its_own_quantization_noise(pool):
    """w8a8 quantizes each rank's slice of the activations per token, so it is not bit-equal
    to one process; its distance from float stays that of one process's w8a8. Compared on the
    prompt rows only: decodes feed back greedy tokens, which such noise can flip (the second
    step's first half decodes the first step's tokens: one flipped there, 2.66 off)."""
    fields = CONFIGS[pool.world_size]
    prompt_rows = PROMPT_ROWS
    _, float_logits = single_process(json.dumps(fields), "paged", "none")
    _, one_process = single_process(json.dumps(fields), "paged", "w8a8")
    own_noise = (one_process - float_logits)[prompt_rows].abs().max().item()
    for _, logits in pool.run(sharded_run, "shm", fields, "paged", "w8a8"):
        assert (logits - float_logits)[prompt_rows].abs().max().item() < 2 * own_noise


def _heads_error(contexts, fields):
    return _model(fields, "paged", "none", contexts["torch"])


def test_heads_that_do_not_divide_are_a_clear_error(pool):
    fields = dict(CONFIGS[pool.world_size], num_attention_heads=5, num_key_value_heads=5,
                  head_dim=16)
    with pytest.raises(RankError, match=f"5 attention heads do not divide over a "
                                        f"tensor-parallel size of {pool.world_size}"):
        pool.run(_heads_error, fields)


def _all_reduce_cases(contexts, all_reduce):
    """Sums of rank-dependent tensors (several sizes, float32 and bfloat16) and a gather."""
    from kvserve.distributed.shm_all_reduce import SharedMemoryCommunicator

    parallel = contexts[all_reduce]
    communicators: list[Communicator] = [parallel.communicator]
    if all_reduce == "shm":  # 4 KiB slots: messages go in several rounds
        communicators.append(SharedMemoryCommunicator(parallel.tp_rank, parallel.tp_size,
                                                      parallel.group, slot_bytes=4096))
    results = []
    for communicator in communicators:
        for dtype in (torch.float32, torch.bfloat16):
            for numel in (1, 576, 32 * 576, 70_001):
                values = torch.randn(numel, generator=torch.Generator().manual_seed(
                    parallel.tp_rank * 1000 + numel)).to(dtype)
                communicator.all_reduce_(values)
                results.append(values)
            strided = torch.zeros(4, 6, dtype=dtype)[:, ::2]
            strided.fill_(parallel.tp_rank + 1)
            communicator.all_reduce_(strided)
            results.append(strided)
        shard = torch.full((5, 7), float(parallel.tp_rank))
        results.append(communicator.all_gather_last_dim(shard))
    return results


@pytest.mark.parametrize("all_reduce", ["shm", "torch"])
def test_all_reduce_sums_and_gathers(pool, all_reduce):
    world = pool.world_size
    per_rank = pool.run(_all_reduce_cases, all_reduce)
    expected = []
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 576, 32 * 576, 70_001):
            expected.append(sum(torch.randn(numel, generator=torch.Generator().manual_seed(
                rank * 1000 + numel)).to(dtype).float() for rank in range(world)))
        expected.append(torch.full((4, 3), float(sum(range(1, world + 1)))))
    expected.append(torch.arange(world).float().repeat_interleave(7).expand(5, -1))
    rounds = len(per_rank[0]) // len(expected)
    for results in per_rank:
        assert all(torch.equal(r, results_0) for r, results_0 in zip(results, per_rank[0]))
        for got, want in zip(results, expected * rounds):
            tolerance = 0.05 * world if got.dtype == torch.bfloat16 else 1e-5
            assert torch.allclose(got.float(), want, atol=tolerance), (got.dtype, got.shape)


def _load_sharded(contexts, directory, backend, quantization="none"):
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model

    model, config = load_model(resolve_model(directory), "float32", attention_backend=backend,
                               parallel=contexts["shm"], quantization=quantization)
    assert config is model.config and config.tensor_parallel_size == contexts["shm"].tp_size
    return ragged_run(model)


def test_each_rank_loads_its_slice_of_an_hf_directory(pool, tmp_path):
    from safetensors.torch import save_file

    fields = dict(CONFIGS[pool.world_size], tie_word_embeddings=False)
    config = tiny_config(vocab_size=VOCAB, **fields)
    full = random_model(config, "float32", seed=5)
    save_file({k: v.contiguous() for k, v in full.hf_state_dict().items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    expected_tokens, expected_logits = ragged_run(
        random_model(config, "float32", seed=5, attention_backend="paged"))
    for tokens, logits in pool.run(_load_sharded, str(tmp_path), "paged"):
        assert (logits - expected_logits).abs().max().item() < 1e-4
        assert tokens == expected_tokens


def _load_gguf_sharded(contexts, path, cache_directory, use_cache):
    """Each rank's shard of a GGUF, its tensors read as the file stores them and sliced, with
    the parsed config cached (written by rank 0 on the first load) or not."""
    import os

    from kvserve.kernels import get_ops
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model

    get_ops(True)  # loaded from the usual cache before the cache directory moves
    previous = os.environ.get("KVSERVE_CACHE_DIR")
    os.environ["KVSERVE_CACHE_DIR"] = cache_directory
    try:
        model, _ = load_model(resolve_model(path), "float32", attention_backend="paged",
                              use_cache=use_cache, parallel=contexts["shm"])
    finally:
        if previous is None:
            del os.environ["KVSERVE_CACHE_DIR"]
        else:
            os.environ["KVSERVE_CACHE_DIR"] = previous
    return ragged_run(model)


def test_each_rank_loads_its_slice_of_a_gguf(pool, tmp_path):
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model
    from tests.helpers import write_gguf

    config = tiny_config(vocab_size=VOCAB, **CONFIGS[pool.world_size])
    full = random_model(config, "float32", seed=5)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, config, {k: v.numpy() for k, v in full.hf_state_dict().items()})
    expected_tokens, expected_logits = ragged_run(
        load_model(resolve_model(path), "float32", attention_backend="paged", use_cache=False)[0])
    cache_directory = str(tmp_path / "cache")
    for use_cache in (True, True, False):  # parsing the config, then from the cache, then without
        for tokens, logits in pool.run(_load_gguf_sharded, str(path), cache_directory,
                                       use_cache):
            assert (logits - expected_logits).abs().max().item() < 1e-4
            assert tokens == expected_tokens
    cached = sorted(f.name.split(".", 1)[1] for f in (tmp_path / "cache" / "gguf").iterdir())
    assert cached == ["config.json"]  # the parsed config only: no second copy of the weights


# --- the slicing rules, without processes


def test_heads_and_sizes_are_validated_with_their_numbers():
    with pytest.raises(ValueError, match="9 attention heads do not divide over a "
                                         "tensor-parallel size of 2"):
        validate_tensor_parallel(tiny_config(num_attention_heads=9, num_key_value_heads=3), 2)
    with pytest.raises(ValueError, match="3 KV heads and a tensor-parallel size of 2"):
        validate_tensor_parallel(tiny_config(num_attention_heads=6, num_key_value_heads=3), 2)
    with pytest.raises(ValueError, match="intermediate size 129 does not divide"):
        validate_tensor_parallel(tiny_config(intermediate_size=129), 2)
    validate_tensor_parallel(tiny_config(num_attention_heads=9, num_key_value_heads=3,
                                         intermediate_size=1536), 3)  # SmolLM2 at TP=3


def test_kv_heads_split_or_replicated():
    config = tiny_config(num_attention_heads=8, num_key_value_heads=2)
    assert [kv_head_range(config, 2, r) for r in range(2)] == [(0, 1), (1, 2)]
    # 4 ranks, 2 KV heads: ranks 0-1 hold query heads 0-3, which read KV head 0
    assert [kv_head_range(config, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert shard_config(config, 4).num_key_value_heads == 1
    assert shard_config(config, 4).num_attention_heads == 2


def test_vocab_shards_are_padded_to_one_width():
    from kvserve.models.layers.embedding import TokenEmbedding

    assert [vocab_range(1000, 3, r) for r in range(3)] == [(0, 334, 334), (334, 668, 334),
                                                          (668, 1000, 334)]
    embedding = TokenEmbedding(10, 1, ParallelContext(tp_rank=2, tp_size=3))
    embedding.load(torch.arange(10.0).view(10, 1))
    assert embedding.weight.flatten().tolist() == [8.0, 9.0, 0.0, 0.0]


def test_a_fused_qkv_tensor_shards_as_its_parts():
    """Phi-3's checkpoints (and a GGUF's attn_qkv) hold Q, K and V in one tensor: a rank takes
    the same rows of it as of the three HF tensors."""
    from kvserve.models.layers.linear import qkv_parallel
    from kvserve.quant import QuantPolicy

    heads, kv_heads, head_dim, hidden = 6, 3, 16, 96
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    for rank in range(3):
        layers = [qkv_parallel(hidden, head_dim, heads, kv_heads, False,
                               QuantPolicy("none", torch.float32), "attn",
                               ParallelContext(tp_rank=rank, tp_size=3)) for _ in range(2)]
        for part, tensor in enumerate((q, k, v)):
            layers[0].load(part, "weight", tensor)
        layers[1].load(None, "weight", torch.cat([q, k, v]))
        assert torch.equal(layers[0].weight, layers[1].weight)
        expected = torch.cat([q[rank * 32:(rank + 1) * 32], k[rank * 16:(rank + 1) * 16],
                              v[rank * 16:(rank + 1) * 16]])
        assert torch.equal(layers[0].weight, expected)


# --- the real model


def _smollm_sharded(contexts, prompts):
    from kvserve.model_source import resolve_model
    from kvserve.models import load_model

    model, config = load_model(resolve_model("smollm2-135m-instruct"), "float32",
                               attention_backend="paged", parallel=contexts["shm"])
    assert (config.num_attention_heads, config.num_key_value_heads) == (3, 1)
    return ragged_run(model, prompts, decode_steps=8)


@pytest.mark.slow
def test_smollm2_at_tp3_matches_one_process(pool, smollm_fp32_paged, tokenizer):
    """SmolLM2-135M (9 heads, 3 KV heads) split over 3 ranks, each loading its slice of the
    GGUF's tensors: float32 logits within 1e-4, greedy tokens equal, 16 prompts."""
    if pool.world_size != 3:
        pytest.skip("9 heads and 3 KV heads split over 3 ranks (or 9), not 2")
    from tests.helpers import RAW_PROMPTS, chat_prompts

    texts = RAW_PROMPTS + chat_prompts(tokenizer) + [
        "The three laws of thermodynamics are", "SELECT name FROM users WHERE",
        "My favourite season is autumn because", "In 1969, the first humans",
        "A good password should", "The recipe calls for two cups of"]
    prompts = [tokenizer.encode(text) for text in texts]
    assert len(prompts) >= 16
    expected_tokens, expected_logits = ragged_run(smollm_fp32_paged, prompts, decode_steps=8)
    for tokens, logits in pool.run(_smollm_sharded, prompts):
        assert (logits - expected_logits).abs().max().item() < 1e-4
        assert tokens == expected_tokens
