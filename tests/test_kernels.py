"""The compiled CPU kernels against their torch reference versions (kvserve/kernels/reference.py):
bit-exact or within rounding in float32, within bf16 rounding in bfloat16, on ragged batches that
mix decode rows, chunked rows with cached context and fresh prompts; at every instruction-set
level the machine can execute."""

import pytest
import torch

from kvserve.attention import build_attention_metadata
from kvserve.kernels import get_ops, reference
from tests.helpers import rope_both


@pytest.fixture
def compiled(kernels):
    """Every test here runs once per instruction-set level (conftest's `kernels`)."""
    return kernels


HEADS, KV_HEADS, DIM = 6, 2, 32
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation(dtype, compiled):
    torch.manual_seed(0)
    x, residual = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype)
    weight = torch.rand(96, dtype=dtype) + 0.5
    _close(compiled.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), dtype)
    x2, res2 = x.clone(), residual.clone()
    compiled.add_rms_norm_(x, residual, weight, 1e-5)
    reference.add_rms_norm_(x2, res2, weight, 1e-5)
    assert torch.equal(residual, res2)  # the residual add rounds exactly as torch's add
    _close(x, x2, dtype)
    gate_up = torch.randn(5, 2 * 40, dtype=dtype) * 3
    _close(compiled.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norms_scale_by_one_plus_weight_in_float(dtype, compiled):
    """weight_offset 1 (Gemma): (1 + w) applied in float32 before the one rounding, as HF's
    GemmaRMSNorm (within rounding: the sum of squares is ordered differently), and never
    Llama's arithmetic."""
    torch.manual_seed(2)
    x, residual = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype)
    weight = torch.rand(96, dtype=dtype) - 0.5
    got = compiled.rms_norm(x, weight, 1e-6, 1.0)
    expected = reference.rms_norm(x, weight, 1e-6, 1.0)
    _close(got, expected, dtype)
    assert (got.float() - reference.rms_norm(x, weight, 1e-6).float()).abs().max() > 0.1
    x2, res2 = x.clone(), residual.clone()
    compiled.add_rms_norm_(x, residual, weight, 1e-6, 1.0)
    reference.add_rms_norm_(x2, res2, weight, 1e-6, 1.0)
    assert torch.equal(residual, res2)
    _close(x, x2, dtype)


@pytest.mark.parametrize("dim", [32, 64, 256])  # 256: Gemma 3's heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_soft_capped_scores(dtype, dim, compiled):
    """Gemma 2's cap (small here, so it binds) in the paged kernel, windowed and not, equals
    the reference's HF-eager arithmetic; and differs from uncapped attention."""
    query_lens, seq_lens = [1, 4, 6, 1], [7, 10, 6, 33]
    metadata, _, kv_cache, qkv = _batch(dtype, query_lens, seq_lens, dim=dim)
    qkv, kv_cache = qkv * 4, kv_cache * 4  # large scores: the cap matters
    seq_ids = torch.arange(len(query_lens), dtype=torch.int32)
    for window in (0, 5):
        args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens,
                metadata.block_tables, HEADS, KV_HEADS, dim, dim**-0.5, window)
        out, expected, uncapped = (torch.zeros(qkv.shape[0], HEADS * dim, dtype=dtype)
                                   for _ in range(3))
        compiled.paged_attention_(qkv, kv_cache, out, *args, 2.0)
        reference.paged_attention_(qkv, kv_cache, expected, *args, 2.0)
        reference.paged_attention_(qkv, kv_cache, uncapped, *args)
        _close(out / 4, expected / 4, dtype)  # values 4x the other tests': tolerances too
        assert (out.float() - uncapped.float()).abs().max() > 0.1


def _batch(dtype, query_lens, seq_lens, block_size=4, dim=DIM):
    torch.manual_seed(1)
    blocks_needed = [(s + block_size - 1) // block_size for s in seq_lens]
    ids = torch.randperm(sum(blocks_needed) + 3).tolist()  # scattered, non-monotonic blocks
    tables, cursor = [], 0
    for count in blocks_needed:
        tables.append(ids[cursor:cursor + count])
        cursor += count
    metadata, positions = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    kv_cache = torch.randn(2, len(ids), block_size, KV_HEADS, dim, dtype=dtype)
    qkv = torch.randn(sum(query_lens), (HEADS + 2 * KV_HEADS) * dim, dtype=dtype)
    return metadata, positions, kv_cache, qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write(dtype, compiled):
    metadata, positions, kv_cache, qkv = _batch(dtype, [3, 1, 5], [3, 9, 12])
    qkv2, cache2 = rope_both(compiled, metadata, positions, kv_cache, qkv, HEADS, KV_HEADS, DIM)
    _close(qkv, qkv2, dtype)
    _close(kv_cache, cache2, dtype)


@pytest.mark.parametrize("dim", [32, 64, 128])  # 64 and 128 take the register-blocked passes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_ragged_causal(dtype, dim, compiled):
    # decode rows, a chunk with cached context, a fresh prompt, a long decode
    query_lens, seq_lens = [1, 4, 6, 1, 1], [7, 10, 6, 33, 1]
    metadata, _, kv_cache, qkv = _batch(dtype, query_lens, seq_lens, dim=dim)
    seq_ids = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables,
            HEADS, KV_HEADS, dim, dim**-0.5, 0)
    out = torch.zeros(qkv.shape[0], HEADS * dim, dtype=dtype)
    expected = torch.zeros_like(out)
    compiled.paged_attention_(qkv, kv_cache, out, *args)
    reference.paged_attention_(qkv, kv_cache, expected, *args)
    _close(out, expected, dtype)


@pytest.mark.parametrize("dim", [32, 64])
def test_bf16_cache_beside_float32_activations(dim, compiled):
    """CPUs without native bf16 keep float32 activations and a bf16 KV cache: the cache write
    rounds K/V to bf16 (as the reference's cast), attention reads them back exactly."""
    metadata, positions, kv_cache, qkv = _batch(torch.float32, [1, 4, 6, 1], [7, 10, 6, 33],
                                                dim=dim)
    kv_cache = kv_cache.to(torch.bfloat16)
    qkv2, cache2 = rope_both(compiled, metadata, positions, kv_cache, qkv, HEADS, KV_HEADS, dim)
    _close(qkv, qkv2, torch.float32)
    assert torch.equal(kv_cache, cache2)  # the same round-to-nearest-even
    seq_ids = torch.arange(4, dtype=torch.int32)
    args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables,
            HEADS, KV_HEADS, dim, dim**-0.5, 0)
    out = torch.zeros(qkv.shape[0], HEADS * dim)
    expected = torch.zeros_like(out)
    compiled.paged_attention_(qkv, kv_cache, out, *args)
    reference.paged_attention_(qkv, kv_cache, expected, *args)
    _close(out, expected, torch.float32)
    with pytest.raises(RuntimeError, match="KV cache"):  # bf16 activations, float cache
        compiled.paged_attention_(qkv.bfloat16(), kv_cache.float(), out.bfloat16(), *args)


# int8 and fp8 (stored as uint8): quantized rows, whose passes are the same for any row count
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8,
                                         reference.FP8_KV_DTYPE])
@pytest.mark.parametrize("dim", [64, 128])  # the register-blocked passes
def test_a_token_verified_among_others_gets_the_bits_of_it_decoded_alone(dim, cache_dtype,
                                                                         compiled):
    """Speculative decoding verifies k tokens in one task; with float32 queries each must get
    the bits it would get decoded alone (greedy tokens equal with drafts on and off). Several
    tokens take other passes than one (AVX2: the listed passes), so this holds only if every
    path computes each row's scores and sums the same way."""
    torch.manual_seed(3)
    n, seq_len, block_size = 9, 300, 16
    blocks = -(-seq_len // block_size)
    table = torch.randperm(blocks + 4)[:blocks].tolist()
    query_lens = [n] + [1] * n
    seq_lens = [seq_len] + [seq_len - n + 1 + j for j in range(n)]
    metadata, _ = build_attention_metadata(query_lens, seq_lens, [table] * (n + 1), block_size)
    kv_cache = reference.to_cache_rows(torch.randn(2, blocks + 4, block_size, KV_HEADS, dim),
                                       cache_dtype)
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * dim).repeat(2, 1)  # the same queries twice
    out = torch.zeros(2 * n, HEADS * dim)
    compiled.paged_attention_(qkv, kv_cache, out, torch.arange(n + 1, dtype=torch.int32),
                              metadata.query_start_loc.long(), metadata.seq_lens,
                              metadata.block_tables, HEADS, KV_HEADS, dim, dim**-0.5, 0)
    assert torch.equal(out[:n], out[n:])


@pytest.mark.parametrize("dim", [32, 64])  # 64: the register-blocked passes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_of_a_sequence_alone_equals_it_in_a_batch(dtype, dim, compiled):
    """Alone, a sequence's few (sequence, KV head) tasks are split into parts of their query
    rows so every thread works (batch-1 decode); the parts give the bits of the whole tasks a
    batch runs, so a request's tokens do not depend on its company."""
    query_lens, seq_lens = [1, 4, 1, 1, 1, 1], [33, 10, 7, 9, 12, 20]
    metadata, _, kv_cache, qkv = _batch(dtype, query_lens, seq_lens, dim=dim)
    tail = (metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables, HEADS,
            KV_HEADS, dim, dim**-0.5, 0)
    starts = metadata.query_start_loc.tolist()
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 4):  # 12 whole tasks in the batch: split at no count here
            torch.set_num_threads(count)
            batch = torch.zeros(qkv.shape[0], HEADS * dim, dtype=dtype)
            compiled.paged_attention_(qkv, kv_cache, batch, torch.arange(6, dtype=torch.int32),
                                      *tail)
            for seq in (0, 1):  # a decode row; a 4-token chunk (12 query rows)
                alone = torch.zeros_like(batch)
                compiled.paged_attention_(qkv, kv_cache, alone,
                                          torch.tensor([seq], dtype=torch.int32), *tail)
                rows = slice(starts[seq], starts[seq + 1])
                assert torch.equal(alone[rows], batch[rows]), (count, seq)
    finally:
        torch.set_num_threads(threads)


def test_paged_attention_only_touches_selected_sequences(compiled):
    metadata, _, kv_cache, qkv = _batch(torch.float32, [1, 1, 1], [5, 6, 7])
    out = torch.full((3, HEADS * DIM), 7.0)
    compiled.paged_attention_(qkv, kv_cache, out, torch.tensor([1], dtype=torch.int32),
                              metadata.query_start_loc.long(), metadata.seq_lens,
                              metadata.block_tables, HEADS, KV_HEADS, DIM, 0.1, 0)
    assert torch.all(out[0] == 7.0) and torch.all(out[2] == 7.0)
    assert not torch.all(out[1] == 7.0)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16])  # key tiles of 16 span blocks of 4
def test_flash_attention_ragged_causal(dim, block_size, compiled):
    """Fresh prompts, chunks over cached context (tile-aligned or not), a decode row and a long
    chunk spanning many query and key tiles, against the float reference."""
    if not compiled.flash_attention_supported(dim):
        pytest.skip(f"no flash kernel in the {compiled.isa} build")
    query_lens, seq_lens = [17, 40, 1, 33, 128, 4], [17, 100, 50, 70, 1500, 9]
    metadata, _, kv_cache, qkv = _batch(torch.bfloat16, query_lens, seq_lens,
                                        block_size=block_size, dim=dim)
    seq_ids = torch.tensor([4, 0, 1, 2, 3, 5], dtype=torch.int32)
    args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables,
            HEADS, KV_HEADS, dim, dim**-0.5, 0)
    out = torch.zeros(qkv.shape[0], HEADS * dim, dtype=torch.bfloat16)
    expected = torch.zeros(qkv.shape[0], HEADS * dim)
    compiled.flash_attention_(qkv, kv_cache, out, *args)
    reference.paged_attention_(qkv.float(), kv_cache.float(), expected, *args)
    # probabilities are rounded to bf16 before P.V, as in GPU flash attention
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_flash_attention_only_touches_selected_sequences_and_checks_inputs(compiled):
    if not compiled.flash_attention_supported(64):
        pytest.skip(f"no flash kernel in the {compiled.isa} build")
    metadata, _, kv_cache, qkv = _batch(torch.bfloat16, [20, 30, 20], [20, 40, 25], dim=64)
    out = torch.full((70, HEADS * 64), 7.0, dtype=torch.bfloat16)
    args = (metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables, HEADS,
            KV_HEADS, 64, 0.125, 0)
    compiled.flash_attention_(qkv, kv_cache, out, torch.tensor([1], dtype=torch.int32), *args)
    assert torch.all(out[:20] == 7.0) and torch.all(out[50:] == 7.0)
    assert not torch.any(out[20:50] == 7.0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        compiled.flash_attention_(qkv.float(), kv_cache.float(), out.float(),
                                  torch.tensor([1], dtype=torch.int32), *args)
    assert not compiled.flash_attention_supported(32)


# ---- sliding windows: a query at p sees keys k with p - k < window (HF's mask)


def _poison_out_of_window(metadata, kv_cache, query_lens, window):
    """What the KV manager may later do to blocks wholly before a sequence's window: reuse them
    (the table entries point at a NaN-filled spare block, the cache's last) and fill them with
    anything (NaN). Returns the clean cache for the naive check."""
    clean = kv_cache.clone()
    block_size, spare = kv_cache.shape[2], kv_cache.shape[1] - 1
    kv_cache[:, spare] = float("nan")
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, metadata.seq_lens_host)):
        first_key = reference.first_visible_key(seq_len - query_len, window)
        for b in range(first_key // block_size):
            kv_cache[:, int(metadata.block_tables[seq, b])] = float("nan")
            metadata.block_tables[seq, b] = spare
    return clean


def _naive_windowed(qkv, clean_cache, tables, metadata, window, dim):
    """Each query row against its sequence's keys, masked by position, float64: the semantics
    the reference must have."""
    out = torch.zeros(qkv.shape[0], HEADS * dim, dtype=torch.float64)
    block_size, group = clean_cache.shape[2], HEADS // KV_HEADS
    starts = metadata.query_start_loc_host
    for seq, seq_len in enumerate(metadata.seq_lens_host):
        slots = [tables[seq][p // block_size] * block_size + p % block_size
                 for p in range(seq_len)]
        keys = clean_cache[0].flatten(0, 1)[slots].double()  # [L, KVH, D]
        values = clean_cache[1].flatten(0, 1)[slots].double()
        for t in range(starts[seq], starts[seq + 1]):
            position = seq_len - (starts[seq + 1] - t)
            k = torch.arange(seq_len)
            visible = (k <= position) & ((position - k < window) if window > 0 else True)
            for h in range(HEADS):
                q = qkv[t, h * dim:(h + 1) * dim].double()
                scores = keys[:, h // group] @ q * dim**-0.5
                probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), 0)
                out[t, h * dim:(h + 1) * dim] = probs @ values[:, h // group]
    return out


# decodes, chunks over cached context (one longer than most windows), a fresh prompt
WINDOW_QUERY_LENS, WINDOW_SEQ_LENS = [1, 4, 6, 1, 1, 9, 1], [7, 30, 6, 33, 1, 45, 64]


@pytest.mark.parametrize("window", [1, 5, 8, 13, 33, 100])  # < = > contexts; not / multiple of 4
@pytest.mark.parametrize("dim", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_sliding_window(dtype, dim, window, compiled):
    metadata, _, kv_cache, qkv = _batch(dtype, WINDOW_QUERY_LENS, WINDOW_SEQ_LENS, dim=dim)
    kv_cache = torch.cat([kv_cache, kv_cache[:, :1]], 1)  # a spare block for _poison
    tables = metadata.block_tables.tolist()
    clean = _poison_out_of_window(metadata, kv_cache, WINDOW_QUERY_LENS, window)
    seq_ids = torch.arange(len(WINDOW_SEQ_LENS), dtype=torch.int32)
    args = (seq_ids, metadata.query_start_loc.long(), metadata.seq_lens, metadata.block_tables,
            HEADS, KV_HEADS, dim, dim**-0.5, window)
    out = torch.zeros(qkv.shape[0], HEADS * dim, dtype=dtype)
    expected = torch.zeros_like(out)
    compiled.paged_attention_(qkv, kv_cache, out, *args)
    reference.paged_attention_(qkv, kv_cache, expected, *args)
    assert torch.isfinite(out).all() and torch.isfinite(expected).all()
    _close(out, expected, dtype)
    naive = _naive_windowed(qkv, clean, tables, metadata, window, dim)
    _close(expected, naive, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_covering_the_context_is_full_attention(dtype, compiled):
    """A window no query reaches past, 0 and -1 all give full attention, bit for bit."""
    metadata, _, kv_cache, qkv = _batch(dtype, WINDOW_QUERY_LENS, WINDOW_SEQ_LENS, dim=64)
    seq_ids = torch.arange(len(WINDOW_SEQ_LENS), dtype=torch.int32)
    outputs = []
    for window in (0, -1, max(WINDOW_SEQ_LENS)):
        out = torch.zeros(qkv.shape[0], HEADS * 64, dtype=dtype)
        compiled.paged_attention_(qkv, kv_cache, out, seq_ids, metadata.query_start_loc.long(),
                                  metadata.seq_lens, metadata.block_tables, HEADS, KV_HEADS, 64,
                                  0.125, window)
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("window", [1, 7, 16, 50, 2000])
@pytest.mark.parametrize("block_size", [4, 16])
def test_flash_attention_sliding_window(window, block_size, compiled):
    """Query tiles whose rows' windows start in different key tiles, rows that see no key of a
    tile, NaN in the blocks before every window."""
    if not compiled.flash_attention_supported(64):
        pytest.skip(f"no flash kernel in the {compiled.isa} build")
    query_lens, seq_lens = [17, 40, 1, 33, 128, 4], [17, 100, 50, 70, 600, 9]
    metadata, _, kv_cache, qkv = _batch(torch.bfloat16, query_lens, seq_lens,
                                        block_size=block_size, dim=64)
    kv_cache = torch.cat([kv_cache, kv_cache[:, :1]], 1)
    _poison_out_of_window(metadata, kv_cache, query_lens, window)
    args = (torch.tensor([4, 0, 1, 2, 3, 5], dtype=torch.int32), metadata.query_start_loc.long(),
            metadata.seq_lens, metadata.block_tables, HEADS, KV_HEADS, 64, 0.125, window)
    out = torch.zeros(qkv.shape[0], HEADS * 64, dtype=torch.bfloat16)
    expected = torch.zeros(qkv.shape[0], HEADS * 64)
    compiled.flash_attention_(qkv, kv_cache, out, *args)
    reference.paged_attention_(qkv.float(), kv_cache.float(), expected, *args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8", "fp8"])
def test_latent_attention_ragged_causal(cache, compiled):
    """MLA's absorbed attention over latent rows (the latent then the RoPE key, quantized parts
    each with its scale): a prompt chunk over cached context, a fresh prompt and a decode row
    in one call, blocks shuffled, within float32 rounding of the torch version."""
    from kvserve.kernels.reference import FP8_KV_DTYPE, to_cache_rows

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
             "fp8": FP8_KV_DTYPE}[cache]
    torch.manual_seed(0)
    heads, rank, rope, block_size = 5, 40, 8, 4  # rank past a whole vector: the scalar tail
    seq_lens, new_tokens = [9, 6, 23], [3, 6, 1]
    order = torch.randperm(24)[:13] + 1  # block 0 stays the tables' padding
    tables, used = torch.zeros(3, 6, dtype=torch.int32), 0
    for index, length in enumerate(seq_lens):
        count = -(-length // block_size)
        tables[index, :count] = order[used:used + count]
        used += count
    rows = torch.cat([to_cache_rows(torch.randn(25 * block_size, rank), dtype),
                      to_cache_rows(torch.randn(25 * block_size, rope), dtype)], dim=-1)
    tokens = sum(new_tokens)
    query_start = torch.tensor([0, 3, 9, 10], dtype=torch.int32)
    q_latent, q_rope = torch.randn(tokens, heads, rank), torch.randn(tokens, heads, rope)
    args = (query_start, torch.tensor(seq_lens, dtype=torch.int32), tables, block_size, 0.3)
    out, expected = torch.zeros(tokens, heads, rank), torch.zeros(tokens, heads, rank)
    every = torch.arange(3, dtype=torch.int32)
    compiled.latent_attention_(out, q_latent, q_rope, rows, every, *args)
    reference.latent_attention_(expected, q_latent, q_rope, rows, every, *args)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # only the sequences asked for: the others' rows stay as they were
    some = torch.full_like(out, 7.0)
    chosen = torch.tensor([0, 2], dtype=torch.int32)
    compiled.latent_attention_(some, q_latent, q_rope, rows, chosen, *args)
    assert torch.equal(some[3:9], torch.full_like(some[3:9], 7.0))
    torch.testing.assert_close(some[:3], expected[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(some[9:], expected[9:], atol=1e-5, rtol=1e-5)


def test_reference_fallback_when_disabled():
    ops = get_ops(False)
    assert not ops.compiled and ops.paged_attention_ is reference.paged_attention_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_quantize_and_dequantize(dtype, compiled):
    torch.manual_seed(3)
    x = torch.randn(9, 64, dtype=dtype) * 4
    x[3] = 0  # an all-zero row gets scale 1, not a division by zero
    codes, scales = compiled.quantize_per_token(x)
    ref_codes, ref_scales = reference.quantize_per_token(x)
    torch.testing.assert_close(scales, ref_scales)
    assert (codes.int() - ref_codes.int()).abs().max() <= 1  # x / s on a .5 boundary may differ
    acc = torch.randint(-50000, 50000, (9, 24), dtype=torch.int32)
    weight_scale, bias = torch.rand(24), torch.randn(24, dtype=dtype)
    for b in (None, bias):
        _close(compiled.dequantize_int32(acc, scales, weight_scale, b, dtype),
               reference.dequantize_int32(acc, scales, weight_scale, b, dtype), dtype)


def test_argmax_rows_matches_torch_including_ties_and_nan(compiled):
    torch.manual_seed(4)
    logits = torch.randn(6, 1000)
    logits[1, 10] = logits[1, 500] = 99.0  # tie: the first index wins
    logits[2, 777] = float("nan")
    logits[3] = -float("inf")
    assert compiled.argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
