"""The torch-op versions of the fused CPU kernels: same signatures, same maths, written as plain
eager PyTorch. They run when asked for (`--no-cpu-kernels`, `KVSERVE_KERNELS=reference`; never
silently in place of a build that failed) and are the reference the kernels are tested against
(tests/test_kernels.py)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvserve.kernels.top_p import top_p_mask_  # noqa: F401  (csrc/sampling.cpp's reference)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             weight_offset: float = 0.0) -> torch.Tensor:
    """HF's LlamaRMSNorm; with a weight_offset (Gemma) HF's GemmaRMSNorm, scaling by
    (weight_offset + weight) in float32 before the one rounding to x's dtype."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset:
        return (hidden * (weight_offset + weight.float())).to(x.dtype)
    return weight * hidden.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float, weight_offset: float = 0.0) -> None:
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps, weight_offset))


def rms_norm_heads_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                    weight_offset: float = 0.0) -> None:
    """QK-norm (Qwen3, Gemma 3): each query and key head of the fused QKV rows RMS-normalised
    over its head_dim values, in place, before RoPE."""
    tokens, q_size = qkv.shape[0], num_heads * head_dim
    query = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    key = qkv[:, q_size:q_size + num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    query.copy_(rms_norm(query, q_weight, eps, weight_offset))
    key.copy_(rms_norm(key, k_weight, eps, weight_offset))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh GELU (HF's gelu_pytorch_tanh), Gemma's MLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_cache_(qkv, positions, cos_sin, kv_cache, slot_mapping, num_heads: int,
                    num_kv_heads: int, head_dim: int) -> None:
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    cos, sin = cos_sin[positions].to(qkv.dtype).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin, sin], -1).unsqueeze(1)
    heads = qkv[:, : q_size + kv_size].view(num_tokens, -1, head_dim)
    first, second = heads.chunk(2, dim=-1)
    heads.copy_(heads * cos + torch.cat([-second, first], dim=-1) * sin)
    key = qkv[:, q_size: q_size + kv_size].reshape(-1, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size:].reshape(-1, num_kv_heads, head_dim)
    write_kv(key, value, kv_cache, slot_mapping)


# ---- quantized KV cache rows: head_dim codes, then the row's float32 scale (4 bytes)
# int8 rows: symmetric int8 codes, scale = absmax / 127. fp8 rows (`--kv-cache-dtype fp8`, vLLM's
# fp8_e4m3): float8 e4m3 codes (torch.float8_e4m3fn: max 448, no inf), scale = absmax / 448.
# A row carries its own scale, so every block copy (offload tiers, P/D transfer, swaps) moves
# codes and scales together and the cache stays one tensor per layer.

KV_SCALE_BYTES = 4
# An fp8 cache is stored as torch.uint8 (the e4m3 codes' bytes), not torch.float8_e4m3fn: CPU
# torch (2.13) has no index_copy_ or torch.equal for float8 types, which the cache writes, the
# P/D transfer and the tests use; uint8 has every op, and no other cache uses it, so the dtype
# alone tells an fp8 cache from int8 and float ones. The codes are read as float8_e4m3fn views.
FP8_KV_DTYPE = torch.uint8
FP8_E4M3_MAX = 448.0
# `--kv-cache-dtype` names of the quantized-row caches (vLLM's fp8 names; both are e4m3)
KV_ROW_DTYPES = {"int8": torch.int8, "fp8": FP8_KV_DTYPE, "fp8_e4m3": FP8_KV_DTYPE}


def is_row_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds quantized rows (codes and a float32 scale each)."""
    return dtype in (torch.int8, FP8_KV_DTYPE)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """A KV cache dtype as processes name it to each other ("fp8_e4m3" for fp8 rows, which are
    stored as uint8): `models.resolve_kv_dtype` reads it back."""
    return "fp8_e4m3" if dtype == FP8_KV_DTYPE else str(dtype).removeprefix("torch.")


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cached (token, KV head) row: head_dim, plus the scale's bytes for
    quantized rows."""
    return head_dim + KV_SCALE_BYTES if is_row_quantized(dtype) else head_dim


def quantize_kv_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., D] -> quantized rows [..., D + 4] of `dtype`, symmetric per row with a float32 scale
    (an all-zero row has scale 0 and zero codes). int8: scale = absmax / 127, codes = round(x /
    scale) to nearest even. fp8 (FP8_KV_DTYPE): scale = absmax / 448, codes = x / scale rounded
    to the nearest e4m3 value (ties to even, torch's float8_e4m3fn conversion)."""
    if not is_row_quantized(dtype):
        raise ValueError(f"{dtype} is not a quantized KV row dtype (int8, or uint8 for fp8)")
    values = x.float()
    fp8 = dtype == FP8_KV_DTYPE
    scale = values.abs().amax(-1, keepdim=True) / (FP8_E4M3_MAX if fp8 else 127)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    if fp8:
        quotient = (values / safe).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        codes = quotient.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = (values / safe).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.view(dtype)], -1)


def kv_codes_as_float(codes: torch.Tensor) -> torch.Tensor:
    """A quantized row's codes (int8, or fp8 e4m3 bytes) -> their values in float32."""
    if codes.dtype == FP8_KV_DTYPE:
        return codes.view(torch.float8_e4m3fn).float()
    return codes.float()


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantized rows [..., D + 4] -> [..., D] = code * scale (in float32, then rounded to
    dtype)."""
    codes = kv_codes_as_float(rows[..., :-KV_SCALE_BYTES])
    scale = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes * scale).to(dtype)


def kv_as(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as held in a cache (quantized rows, bf16 or float) -> values in dtype."""
    if is_row_quantized(stored.dtype):
        return dequantize_kv_rows(stored, dtype)
    return stored.to(dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What a K/V tensor reads back as after a trip through a cache of cache_dtype (the paths
    that attend over fresh K/V without reading the cache still see the cache's values)."""
    if cache_dtype == x.dtype:
        return x
    return kv_as(to_cache_rows(x, cache_dtype), x.dtype)


def to_cache_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K/V [..., D] as a cache of cache_dtype stores them (quantized rows, or a cast)."""
    return quantize_kv_rows(x, cache_dtype) if is_row_quantized(cache_dtype) \
        else x.to(cache_dtype)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter K/V [T, KVH, D] into their cache slots (rounded to the cache's dtype: a bf16 cache
    may hold float32 activations' K/V; an int8 or fp8 cache holds quantized rows)."""
    num_kv_heads, row = key.shape[1], kv_cache.shape[-1]
    for half, rows in enumerate((key, value)):
        kv_cache[half].view(-1, num_kv_heads, row).index_copy_(
            0, slot_mapping, to_cache_rows(rows, kv_cache.dtype))


def first_visible_key(position: int, sliding_window: int) -> int:
    """The first key a query at `position` sees: keys k with position - k < sliding_window
    (HF's sliding-window mask), every earlier key when sliding_window <= 0 (no window)."""
    return max(0, position - sliding_window + 1) if sliding_window > 0 else 0


def attention_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                   sliding_window: int) -> torch.Tensor:
    """bool [queries, keys]: causal, and within the window when sliding_window > 0."""
    visible = key_positions[None, :] <= query_positions[:, None]
    if sliding_window > 0:
        visible &= key_positions[None, :] > query_positions[:, None] - sliding_window
    return visible


def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor, scale: float, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention written out, as HF's eager paths compute what SDPA cannot: scores scaled, then
    (softcap > 0, Gemma 2) cap * tanh(scores / cap), masked; `sinks` (gpt-oss, [H]) adds each
    head's learned logit as one more softmax column that weighs no value; softmax in float32.
    query [H, n, D], key and value [KVH, L, D], mask bool [n, L] -> [H, n, D]."""
    group = query.shape[0] // key.shape[0]
    key, value = key.repeat_interleave(group, 0), value.repeat_interleave(group, 0)
    scores = torch.matmul(query, key.transpose(1, 2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(query.dtype), value)


def swigluoai_and_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation over [T, 2I] rows [gate | up] (HF's GptOssExperts._apply_gate,
    after the checkpoint's interleaved gate/up columns are split at load): the gate clamped
    above at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate), in float32
    and rounded once (as the fused MoE's kernel; HF rounds each step in bfloat16)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).to(gate_up.dtype)


def plain_scores(softcap: float, sinks: torch.Tensor | None) -> bool:
    """Whether attention is SDPA's (no soft cap, no sinks): the fused kernels' fast paths."""
    return softcap <= 0 and sinks is None


def attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                 sliding_window: int, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt with nothing cached before it over its own K/V: query [H, n, D], key and value
    [KVH, n, D] -> [H, n, D]. Plain causal SDPA unless a window cuts the prompt (then banded);
    soft-capped scores or sinks: `eager_attention`."""
    length = query.shape[1]
    if not plain_scores(softcap, sinks):
        positions = torch.arange(length, device=query.device)
        mask = attention_mask(positions, positions, sliding_window)
        return eager_attention(query, key, value, mask, scale, softcap, sinks)
    if 0 < sliding_window < length:
        positions = torch.arange(length, device=query.device)
        mask = attention_mask(positions, positions, sliding_window)
        return F.scaled_dot_product_attention(query[None], key[None], value[None],
                                              attn_mask=mask, scale=scale, enable_gqa=True)[0]
    # 4-D inputs: with 3-D ones torch takes a slow path (measured 50 ms vs 3 ms per layer for
    # 256 tokens, docs/performance-journal.md)
    return F.scaled_dot_product_attention(query[None], key[None], value[None], is_causal=True,
                                          scale=scale, enable_gqa=True)[0]


def attend_gathered(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int, scale: float, sliding_window: int,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's new queries [n, H, D] (the last n of its seq_len tokens) against its cached
    K/V, gathered from its blocks; causal, within the window if any. Blocks wholly before the
    first query's window are never read (their table entries may be stale). The reference
    algorithm -> [n, H, D]."""
    query_len, block_size = query.shape[0], kv_cache.shape[2]
    first_key = first_visible_key(seq_len - query_len, sliding_window)
    first_block = first_key // block_size
    blocks = block_table[first_block: (seq_len + block_size - 1) // block_size].long()
    skip, end = first_key - first_block * block_size, seq_len - first_block * block_size
    keys = kv_as(kv_cache[0, blocks].flatten(0, 1)[skip:end], query.dtype)
    values = kv_as(kv_cache[1, blocks].flatten(0, 1)[skip:end], query.dtype)
    query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
    key_positions = torch.arange(first_key, seq_len, device=query.device)
    mask = attention_mask(query_positions, key_positions, sliding_window)
    if not plain_scores(softcap, sinks):
        return eager_attention(query.transpose(0, 1), keys.transpose(0, 1),
                               values.transpose(0, 1), mask, scale, softcap,
                               sinks).transpose(0, 1)
    attended = F.scaled_dot_product_attention(  # 4-D inputs: 3-D ones take a slow CPU path
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True)[0]
    return attended.transpose(0, 1)


def paged_attention_(qkv, kv_cache, out, seq_ids, query_start_loc, seq_lens, block_tables,
                     num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                     sliding_window: int, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> None:
    """sliding_window <= 0: full causal attention; softcap > 0: Gemma 2's score capping;
    sinks: gpt-oss's learned per-head sink logits."""
    for seq in seq_ids.tolist():
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        query = qkv[start:end, : num_heads * head_dim].reshape(end - start, num_heads, head_dim)
        attended = attend_gathered(query, kv_cache, block_tables[seq], int(seq_lens[seq]), scale,
                                   sliding_window, softcap, sinks)
        out[start:end] = attended.reshape(end - start, -1)


def latent_attention_(out, q_latent, q_rope, rows, seq_ids, query_start_loc, seq_lens,
                      block_tables, block_size: int, scale: float) -> None:
    """Latent attention (MLA), absorbed, for the sequences in `seq_ids` (other rows of `out`
    left as they are): `out` [T, H, R] gets each query token's and head's
    softmax-weighted sum of its sequence's cached latents, scored as scale x (q_latent .
    latent + q_rope . rope key) over positions up to its own. `rows` [slots, row]: the layer's
    cache, one row a token (the latent, then the RoPE key; quantized parts each with its
    scale); q_latent [T, H, R] and q_rope [T, H, P] float32."""
    rank = q_latent.shape[-1]
    split = kv_row_width(rank, rows.dtype)  # where the RoPE key's part starts
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    for index in seq_ids.tolist():
        length, start, end = lengths[index], starts[index], starts[index + 1]
        if end == start:
            continue
        blocks = block_tables[index, :-(-length // block_size)].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
        cached = rows[slots]
        latents = kv_as(cached[:, :split], torch.float32)
        keys_rope = kv_as(cached[:, split:], torch.float32)
        scores = (torch.einsum("thr,lr->htl", q_latent[start:end], latents)
                  + torch.einsum("thp,lp->htl", q_rope[start:end], keys_rope)) * scale
        query_positions = torch.arange(length - (end - start), length)
        future = torch.arange(length)[None, :] > query_positions[:, None]
        probabilities = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("htl,lr->thr", probabilities, latents)


# The flash kernel computes the same attention as the paged one (tiled, bf16 dot products).
flash_attention_ = paged_attention_


def flash_attention_supported(head_dim: int) -> bool:
    """The torch ops have no separate tiled kernel; the attention backend routes to it only when
    the compiled one is loaded."""
    return False


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = x.float()
    scale = values.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (values / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int32(acc, token_scale, weight_scale, bias, dtype) -> torch.Tensor:
    out = acc.float() * token_scale[:, None] * weight_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def lora_add_(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              slots: torch.Tensor, gemm_rows: int | None = None) -> None:
    """out[t] += (x[t] @ a[s].T) @ b[s] for each row t of slot s = slots[t] >= 0, in float32
    (csrc/lora.cpp): each slot's rows gathered, two matmuls, the sum scattered back (every row
    alike: `gemm_rows`, the kernel's switch to GEMMs for long runs, changes nothing here)."""
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        delta = (x.index_select(0, rows).float() @ a[slot].float().T) @ b[slot].float()
        out.index_copy_(0, rows, (out.index_select(0, rows).float() + delta).to(out.dtype))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def draw_rows(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row from the softmax of its logits (csrc/sampling.cpp): the first
    token whose running float64 sum of e^(logit - best) exceeds uniform x the row's total; a
    -inf logit is never drawn, a row without a finite best (or with a NaN) draws 0."""
    peak = logits.amax(dim=-1, keepdim=True)
    usable = torch.isfinite(peak).squeeze(1) & ~logits.isnan().any(dim=-1)
    mass = torch.exp(logits.double() - peak.double()).nan_to_num_(nan=0.0)
    running = mass.cumsum(dim=-1)
    target = (uniforms * running[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(running, target, right=True).squeeze(1)
    last_positive = (mass > 0).cumsum(dim=-1).argmax(dim=-1)  # the first max: the last step
    return torch.where(usable, torch.minimum(drawn, last_positive), 0)


# byte value -> its 8 bits, lowest first (a little-endian word's bytes are its tokens in order)
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                         mask_rows: torch.Tensor) -> None:
    """Structured output's mask (csrc/sampling.cpp), in place: logits row rows[i] gets -inf
    wherever bit (token % 32) of word (token // 32) of bitmask row mask_rows[i] is clear; a row
    whose mask allows none of its tokens is left alone."""
    if not len(rows):
        return
    vocab = logits.shape[1]
    allowed = _BYTE_BITS[bitmask[mask_rows].view(torch.uint8).long()].flatten(1)[:, :vocab]
    allowed[~allowed.any(dim=1)] = True
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


# ---- int4 weight-only GEMM (csrc/int4_gemm.cpp): its weight layout and the reference maths

INT4_GROUP, INT4_PANEL, INT4_CODE_BYTES = 32, 16, 256


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              meta_dtype: torch.dtype) -> torch.Tensor:
    """codes [N, K] in 0..15, scale and zero [N, K / 32] (w = (q - 8) * scale + zero) -> the
    kernel's panel layout, uint8 [P, G, B]: P = ceil(N / 16) panels of 16 rows, G = K / 32 groups,
    and per (panel, group) a block of 256 bytes of codes, then the panel's 16 scales, then its 16
    zeros in meta_dtype (bfloat16: B = 320, float32: B = 384). In the codes, byte pair (2e, 2e+1)
    of 64-byte chunk c is a little-endian word whose nibble j holds
    q[16 p + e // 2, 32 g + 8 c + 2 j + e % 2]. Rows past N are zero (computed, never stored)."""
    rows, cols = codes.shape
    groups, panels = cols // INT4_GROUP, -(-rows // INT4_PANEL)
    parts = [_int4_code_bytes(codes)]
    for meta in (scale, zero):
        padded_meta = torch.zeros(panels * INT4_PANEL, groups, dtype=meta_dtype)
        padded_meta[:rows] = meta.to(meta_dtype)
        per_block = padded_meta.view(panels, INT4_PANEL, groups).transpose(1, 2).contiguous()
        parts.append(per_block.view(torch.uint8).view(panels, groups, -1))
    return torch.cat(parts, -1).contiguous()


def _int4_code_bytes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (their low 4 bits) -> the int4 layout's code bytes, uint8 [P, K / 32, 256],
    rows past N zero."""
    rows, cols = codes.shape
    groups, panels = cols // INT4_GROUP, -(-rows // INT4_PANEL)
    padded = torch.zeros(panels * INT4_PANEL, cols, dtype=torch.uint8)
    padded[:rows] = codes.to(torch.uint8) & 15
    # [p, lane, g, chunk, j, parity] -> [p, g, chunk, lane, parity, j]
    q = padded.view(panels, INT4_PANEL, groups, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)  # byte b of a word: nibbles j = 2b, 2b + 1
    return packed.reshape(panels, groups, INT4_CODE_BYTES)


def _int4_codes(code_bytes: torch.Tensor) -> torch.Tensor:
    """_int4_code_bytes's inverse: uint8 [P, G, 256] -> codes uint8 [P * 16, G, 32]."""
    panels, groups, _ = code_bytes.shape
    codes = code_bytes.reshape(panels, groups, 4, INT4_PANEL, 2, 2)
    q = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)  # [p, g, chunk, lane, parity, j]
    return q.permute(0, 3, 1, 2, 5, 4).reshape(panels * INT4_PANEL, groups, INT4_GROUP)


def _unpack_int4_parts(packed: torch.Tensor, meta_dtype: torch.dtype):
    """The panel layout -> codes float [N_padded, G, 32] and the two per-group metadata arrays
    [N_padded, G, 1] as float32."""
    panels, groups, _ = packed.shape
    q = _int4_codes(packed[..., :INT4_CODE_BYTES])
    meta = packed[..., INT4_CODE_BYTES:].contiguous().view(meta_dtype).float()  # [p, g, 32]
    first, second = (part.transpose(1, 2).reshape(panels * INT4_PANEL, groups, 1)
                     for part in meta.split(INT4_PANEL, -1))
    return q.float(), first, second


def unpack_int4(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The panel layout back to float32 weights [N, K] = (q - 8) * scale + zero."""
    meta_dtype = torch.bfloat16 if packed.shape[2] == INT4_CODE_BYTES + 64 else torch.float32
    q, scale, zero = _unpack_int4_parts(packed, meta_dtype)
    weight = (q - 8) * scale + zero
    return weight.view(q.shape[0], -1)[:out_features]


def unpack_int4_q8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The integer-dot kernel's panels (metadata scale and low, float16 in 320-byte blocks or
    float32 in 384-byte ones) back to float32 weights [N, K] = q * scale + low."""
    meta_dtype = torch.float16 if packed.shape[2] == INT4_CODE_BYTES + 64 else torch.float32
    q, scale, low = _unpack_int4_parts(packed, meta_dtype)
    return (q * scale + low).view(q.shape[0], -1)[:out_features]


def int4_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    weight = unpack_int4(packed, out_features)
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def int4_linear_fast() -> bool:
    """The reference dequantizes the whole matrix per call: never the fast path."""
    return False


# ---- int8 groupwise weight-only GEMM (csrc/int8_gemm.cpp): GGUF Q8_0's blocks in panels

INT8_GROUP, INT8_PANEL, INT8_CODE_BYTES = 32, 16, 512


def quantize_int8_groupwise(weight: torch.Tensor, group_size: int = INT8_GROUP):
    """float [N, K] -> codes int8 [N, K], scales float32 [N, K / group]: symmetric absmax / 127
    per group, as GGUF's Q8_0. Re-quantizing a Q8_0 tensor's dequantized values this way gives
    back its codes and fp16 scales exactly (its absmax code is +-127 by construction)."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // group_size, group_size)
    scale = groups.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (groups / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.view(rows, cols), scale


def pack_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes int8 [N, K], scales [N, K / 32] -> uint8 [P, G, 576]: per (panel of 16 rows, group
    of 32 along K) 8 chunks of 64 bytes, chunk c holding k = 4c..4c+3 of row n at bytes
    4n..4n+3, then the 16 rows' float32 scales. Rows past N are zero."""
    rows, cols = codes.shape
    groups, panels = cols // INT8_GROUP, -(-rows // INT8_PANEL)
    padded = torch.zeros(panels * INT8_PANEL, cols, dtype=torch.int8)
    padded[:rows] = codes
    # [p, lane, g, chunk, byte] -> [p, g, chunk, lane, byte]
    q = padded.view(panels, INT8_PANEL, groups, 8, 4).permute(0, 2, 3, 1, 4)
    parts = [q.reshape(panels, groups, INT8_CODE_BYTES).view(torch.uint8)]
    padded_scale = torch.zeros(panels * INT8_PANEL, groups, dtype=torch.float32)
    padded_scale[:rows] = scale.float()
    per_block = padded_scale.view(panels, INT8_PANEL, groups).transpose(1, 2).contiguous()
    parts.append(per_block.view(torch.uint8).view(panels, groups, -1))
    return torch.cat(parts, -1).contiguous()


def unpack_int8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The panel layout back to float32 weights [N, K] = q * scale."""
    panels, groups, _ = packed.shape
    codes = packed[..., :INT8_CODE_BYTES].contiguous().view(torch.int8)
    q = codes.view(panels, groups, 8, INT8_PANEL, 4).permute(0, 3, 1, 2, 4)
    q = q.reshape(panels * INT8_PANEL, groups, INT8_GROUP)
    scale = packed[..., INT8_CODE_BYTES:].contiguous().view(torch.float32)  # [p, g, 16]
    scale = scale.transpose(1, 2).reshape(panels * INT8_PANEL, groups, 1)
    return (q.float() * scale).view(panels * INT8_PANEL, -1)[:out_features]


def int8_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    weight = unpack_int8(packed, out_features)
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


# ---- integer-dot GEMVs (csrc/q8_dot_gemm.cpp): x rounded to int8 per group of 32

def quantize_activations_q8(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x [M, K] -> x' = d * round(x / d) per group of 32 along K, d = absmax / 127 (llama.cpp's
    Q8 activations): the values the integer-dot kernels multiply exactly, as float32."""
    rows, cols = x.shape
    groups = x.float().reshape(rows, cols // group, group)
    step = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return (torch.round(groups * inverse) * step).view(rows, cols)


def quantize_activations_q8k(x: torch.Tensor) -> torch.Tensor:
    """quantize_activations_q8 per super-block of 256 (llama.cpp's Q8_K activations): the
    values gguf_linear_q8k multiplies exactly."""
    return quantize_activations_q8(x, group=256)


def int4_linear_q8(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """Panels from pack_int4(codes, scale, low, float16 or float32): w = q * scale + low."""
    weight = unpack_int4_q8(packed, out_features)
    out = F.linear(quantize_activations_q8(x), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def int8_linear_q8(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    return int8_linear(quantize_activations_q8(x), packed, bias, out_features).to(x.dtype)


def q8_dot_wide() -> bool:
    """The reference has no integer dot products: never the wide path."""
    return False


# ---- bf16 weight GEMM (csrc/bf16_gemm.cpp): bf16 weights in panels of 16 rows

BF16_GROUP, BF16_PANEL = 32, 16


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] (K divisible by 32) -> uint8 [P, K / 32, 1024]: the weights rounded to bf16;
    per (panel of 16 rows, 32 along K) 16 chunks of 64 bytes, chunk c holding the pair
    (w[n, 2c], w[n, 2c + 1]) of row n at bytes 4n..4n+3. Rows past N are zero."""
    rows, cols = weight.shape
    groups, panels = cols // BF16_GROUP, -(-rows // BF16_PANEL)
    padded = torch.zeros(panels * BF16_PANEL, cols, dtype=torch.bfloat16)
    padded[:rows] = weight.to(torch.bfloat16)
    # [p, lane, g, pair, 2] -> [p, g, pair, lane, 2]
    pairs = padded.view(panels, BF16_PANEL, groups, BF16_GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    return pairs.contiguous().view(torch.uint8).view(panels, groups, -1)


def unpack_bf16(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The panel layout back to float32 weights [N, K]."""
    panels, groups, _ = packed.shape
    pairs = packed.contiguous().view(torch.bfloat16).view(panels, groups, BF16_GROUP // 2,
                                                          BF16_PANEL, 2)
    weight = pairs.permute(0, 3, 1, 2, 4).reshape(panels * BF16_PANEL, groups * BF16_GROUP)
    return weight.float()[:out_features]


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    weight = unpack_bf16(packed, out_features)
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


# ---- GGUF block formats kept as the file stores them (csrc/gguf_layouts.h, gguf_pack.cpp,
# gguf_gemm.cpp): the file's codes and scales in panels of 16 rows

# name: (values a file block, bytes a file block, bytes a (panel, file block) of the layout)
GGUF_FORMATS = {"Q4_0": (32, 18, 320), "Q4_1": (32, 20, 320), "Q5_0": (32, 22, 352),
                "Q5_1": (32, 24, 384), "Q8_0": (32, 34, 576), "Q4_K": (256, 144, 2368),
                "Q5_K": (256, 176, 2880), "Q6_K": (256, 210, 3360), "MXFP4": (32, 17, 320)}
# MXFP4's e2m1 codes as the integers they are in halves of the block's scale (ggml's table)
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                             dtype=torch.float32)
# the K-quants: super-blocks of 256 whose sub-block scales are integers (gguf_linear_q8k)
SUPERBLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# bits above the low 4 a code, kept in bit planes
_HIGH_BITS = {"Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q6_K": 2}


def _gguf_format(qtype: str) -> tuple[int, int, int]:
    if qtype not in GGUF_FORMATS:
        raise ValueError(f"GGUF type {qtype} has no panel layout; supported: "
                         f"{', '.join(GGUF_FORMATS)}")
    return GGUF_FORMATS[qtype]


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes start, start + 1 of each file block: [N, B]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0]


def _bits(bytes_: torch.Tensor) -> torch.Tensor:
    """Bit j of each byte: [..., bytes, 8] uint8."""
    return (bytes_[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> [N, B, 8] each (gguf's get_scale_min)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], -1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], -1)
    return scales, mins


def _gguf_decode(raw: torch.Tensor, qtype: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A GGUF tensor's bytes [N, row_bytes] -> its codes uint8 [N, K] (high bits included) and
    its per-block metadata: float16 [N, B], or [N, B, 8] (K-quants' scales and mins), [N, B, 16]
    (Q6_K's int8 scales)."""
    values, size, _ = _gguf_format(qtype)
    rows, row_bytes = raw.shape
    if row_bytes == 0 or row_bytes % size:
        raise ValueError(f"gguf_pack: {qtype} rows of {row_bytes} bytes are not whole blocks "
                         f"({size} bytes per {values} values)")
    blocks = raw.view(rows, row_bytes // size, size)
    if qtype == "Q8_0":
        return blocks[..., 2:].reshape(rows, -1), {"d": _halves(blocks, 0)}
    if qtype == "MXFP4":  # Q4_0's nibble order, the E8M0 scale 2^(e - 128) as float32
        qs = blocks[..., 1:]
        scale = torch.ldexp(torch.ones(()), blocks[..., 0].float() - 128)
        return torch.cat([qs & 15, qs >> 4], -1).reshape(rows, -1), {"d": scale}
    if qtype == "Q6_K":
        ql = blocks[..., :128].reshape(rows, -1, 2, 2, 32)  # [N, B, h, s % 2, l]
        low = torch.stack([ql & 15, ql >> 4], 3)          # [N, B, h, s // 2, s % 2, l]
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
        high = (qh >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3  # [N, B, h, s, l]
        codes = low.reshape(rows, -1, 8, 32) | (high.reshape(rows, -1, 8, 32) << 4)
        scales = blocks[..., 192:208].contiguous().view(torch.int8)  # [N, B, 16]
        return codes.reshape(rows, -1), {"d": _halves(blocks, 208), "scales": scales}
    if qtype in ("Q4_K", "Q5_K"):
        qs = blocks[..., -128:].reshape(rows, -1, 4, 1, 32)
        codes = torch.cat([qs & 15, qs >> 4], 3).reshape(rows, -1, 8, 32)
        if qtype == "Q5_K":  # bit s of qh[l]: element l of sub-block s
            codes = codes | (_bits(blocks[..., 16:48]).transpose(-1, -2) << 4)
        scales, mins = _k_scales(blocks[..., 4:16])
        meta = {"d": _halves(blocks, 0), "dmin": _halves(blocks, 2), "scales": scales,
                "mins": mins}
        return codes.reshape(rows, -1), meta
    # Q4_0, Q4_1, Q5_0, Q5_1: d (m) (qh) qs[16], element j < 16 in qs[j]'s low nibble
    with_min = qtype in ("Q4_1", "Q5_1")
    qs = blocks[..., -16:]
    codes = torch.cat([qs & 15, qs >> 4], -1)
    if qtype in ("Q5_0", "Q5_1"):
        start = 4 if with_min else 2
        codes = codes | (_bits(blocks[..., start:start + 4]).flatten(-2) << 4)
    meta = {"d": _halves(blocks, 0)}
    if with_min:
        meta["m"] = _halves(blocks, 2)
    return codes.reshape(rows, -1), meta


def _panel_rows(meta: torch.Tensor, panels: int) -> torch.Tensor:
    """Per-row metadata [N, B, ...] -> [P, B, ..., 16] as bytes [P, B, -1] (rows last, zero
    past N)."""
    padded = torch.zeros((panels * INT4_PANEL, *meta.shape[1:]), dtype=meta.dtype)
    padded[:meta.shape[0]] = meta
    per_panel = padded.view(panels, INT4_PANEL, *meta.shape[1:]).movedim(1, -1).contiguous()
    return per_panel.view(torch.uint8).reshape(panels, meta.shape[1], -1)


def _plane_bytes(codes: torch.Tensor, high_bits: int) -> torch.Tensor:
    """codes [N, K] -> their bit planes uint8 [P, K / 32, 64 * high_bits]: bit high_bits * v
    (plane v * high_bits // 8) of byte b holds the bits above 4 of code vector v's byte b, the
    code of row b // 4 at k = 8 (v // 2) + 4 (b % 2) + 2 (v % 2) + (b // 2) % 2."""
    rows, cols = codes.shape
    groups, panels = cols // INT4_GROUP, -(-rows // INT4_PANEL)
    high = torch.zeros(panels * INT4_PANEL, cols, dtype=torch.int32)
    high[:rows] = (codes >> 4).int()
    # [p, n, g, c, hb, h, par] -> [p, g, (n, par, hb) = byte, (c, h) = vector]
    high = high.view(panels, INT4_PANEL, groups, 4, 2, 2, 2).permute(0, 2, 1, 6, 4, 3, 5)
    bits = (high.reshape(panels, groups, 64, 8) << (high_bits * torch.arange(8))).sum(-1)
    planes = [(bits >> (8 * i)) & 0xFF for i in range(high_bits)]
    return torch.cat(planes, -1).to(torch.uint8)


def _plane_codes(planes: torch.Tensor, high_bits: int) -> torch.Tensor:
    """_plane_bytes's inverse: uint8 [P, G, 64 * high_bits] -> the high bits [P * 16, G, 32]."""
    panels, groups, _ = planes.shape
    bits = sum(planes[..., 64 * i:64 * (i + 1)].int() << (8 * i) for i in range(high_bits))
    high = (bits[..., None] >> (high_bits * torch.arange(8))) & ((1 << high_bits) - 1)
    # [p, g, n, par, hb, c, h] -> [p, n, g, c, hb, h, par]
    high = high.view(panels, groups, INT4_PANEL, 2, 2, 4, 2).permute(0, 2, 1, 5, 4, 6, 3)
    return high.reshape(panels * INT4_PANEL, groups, INT4_GROUP).to(torch.uint8)


def gguf_pack(raw: torch.Tensor, qtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """A GGUF tensor's bytes, uint8 [N, row_bytes] -> panels uint8 [ceil(N / 16), blocks a row,
    bytes a (panel, block)] (the layouts of csrc/gguf_layouts.h); rows past N are zero. `out`:
    panels of that shape to write instead (a run of a larger tensor's)."""
    panels = _gguf_pack(raw, qtype)
    if out is None:
        return panels
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.shape != panels.shape:
        raise ValueError(f"gguf_pack: out must be contiguous uint8 {tuple(panels.shape)}, got "
                         f"{tuple(out.shape)}")
    return out.copy_(panels)


def _gguf_pack(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    codes, meta = _gguf_decode(raw, qtype)
    rows, cols = codes.shape
    panels, blocks = -(-rows // INT4_PANEL), raw.shape[1] // GGUF_FORMATS[qtype][1]
    if qtype == "Q8_0":
        return pack_int8(codes.view(torch.int8), meta["d"].float())
    if qtype in ("Q4_0", "Q4_1"):
        low = meta["m"] if qtype == "Q4_1" else (-8 * meta["d"].float()).half()
        d = meta["d"].float()
        if qtype == "Q4_0" and ((d.abs() > 8188) & d.isfinite()).any():
            raise ValueError(f"gguf_pack: a {qtype} block's scale d exceeds 8188, so its low -8d "
                             "does not fit the layout's float16")
        return pack_int4(codes, meta["d"], low, torch.float16)
    parts = [_int4_code_bytes(codes).view(panels, blocks, -1)]
    if qtype in _HIGH_BITS:
        parts.append(_plane_bytes(codes, _HIGH_BITS[qtype]).view(panels, blocks, -1))
    parts += [_panel_rows(value, panels) for value in meta.values()]
    return torch.cat(parts, -1).contiguous()


def _gguf_weights(panels: torch.Tensor, qtype: str) -> torch.Tensor:
    """gguf_pack's panels -> the file's values float32 [P * 16, K], with gguf.quants.dequantize's
    float operations in its order."""
    values, _, block_bytes = _gguf_format(qtype)
    count, blocks, _ = panels.shape
    if qtype == "Q8_0":
        return unpack_int8(panels, count * INT4_PANEL)
    if qtype in ("Q4_0", "Q4_1"):
        q, d, m = _unpack_int4_parts(panels, torch.float16)
        return (d * (q - 8) if qtype == "Q4_0" else d * q + m).view(q.shape[0], -1)
    groups = values // INT4_GROUP
    code_bytes = 256 * groups
    q = _int4_codes(panels[..., :code_bytes].reshape(count, -1, 256))
    offset = code_bytes
    if qtype in _HIGH_BITS:
        plane_bytes = 64 * _HIGH_BITS[qtype] * groups
        planes = panels[..., offset:offset + plane_bytes].reshape(count, blocks * groups, -1)
        q = q | (_plane_codes(planes, _HIGH_BITS[qtype]) << 4)
        offset += plane_bytes
    q = q.float().view(count * INT4_PANEL, blocks, groups, INT4_GROUP)

    def rows_of(nbytes: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        """The next per-row array: [P * 16, B, *shape] as float32."""
        nonlocal offset
        part = panels[..., offset:offset + nbytes].contiguous().view(dtype)
        offset += nbytes
        part = part.view(count, blocks, *shape, INT4_PANEL).movedim(-1, 1)
        return part.reshape(count * INT4_PANEL, blocks, *shape).float()

    if qtype == "MXFP4":  # the codes index the e2m1 values; d float32
        d = rows_of(64, torch.float32)[..., None, None]
        return (d * _MXFP4_VALUES[q.long()]).reshape(count * INT4_PANEL, -1)
    d = rows_of(32, torch.float16)[..., None, None]
    if qtype == "Q5_0":
        weight = d * (q - 16)
    elif qtype == "Q5_1":
        weight = d * q + rows_of(32, torch.float16)[..., None, None]
    elif qtype == "Q6_K":  # a scale per 16: [rows, B, 16] -> [rows, B, 8 groups, 32]
        scales = rows_of(256, torch.int8, 16).view(-1, blocks, 8, 2).repeat_interleave(16, -1)
        weight = (d * scales) * (q - 32)
    else:  # Q4_K, Q5_K
        dmin = rows_of(32, torch.float16)[..., None, None]
        scales = rows_of(128, torch.uint8, 8)[..., None]
        mins = rows_of(128, torch.uint8, 8)[..., None]
        weight = (d * scales) * q - dmin * mins
    return weight.reshape(count * INT4_PANEL, -1)


def gguf_dequantize(panels: torch.Tensor, qtype: str, rows, in_features: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows (int64 [R] or a range) of gguf_pack's panels -> [R, K] in dtype: the float32 values
    gguf.quants.dequantize gives, then cast."""
    weight = _gguf_weights(panels, qtype)
    if weight.shape[1] != in_features:
        raise ValueError(f"gguf_dequantize: {qtype} panels {tuple(panels.shape)} do not hold "
                         f"K = {in_features}")
    index = torch.arange(rows.start, rows.stop) if isinstance(rows, range) else rows
    return weight[index].to(dtype)


def gguf_linear_q8(x: torch.Tensor, panels: torch.Tensor, qtype: str,
                   bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    weight = _gguf_weights(panels, qtype)[:out_features]
    out = F.linear(quantize_activations_q8(x), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def gguf_linear_q8k(x: torch.Tensor, panels: torch.Tensor, qtype: str,
                    bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    if qtype not in SUPERBLOCK_TYPES:
        raise ValueError(f"gguf_linear_q8k: {qtype} has no super-blocks (Q4_K, Q5_K and Q6_K do)")
    weight = _gguf_weights(panels, qtype)[:out_features]
    out = F.linear(quantize_activations_q8k(x), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


# rows from which gguf_linear_int takes super-block activations (csrc/gguf_gemm.h)
SUPERBLOCK_MIN_ROWS = 8
_superblocks = [os.environ.get("KVSERVE_GGUF_SUPERBLOCKS", "1") != "0"]


def gguf_superblocks_enabled() -> bool:
    return _superblocks[0]


def set_gguf_superblocks(enabled: bool) -> None:
    _superblocks[0] = bool(enabled)


def gguf_linear_int(x: torch.Tensor, panels: torch.Tensor, qtype: str,
                    bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The engine's integer path: gguf_linear_q8k for a K-quant call of SUPERBLOCK_MIN_ROWS
    rows or more (where switched on), gguf_linear_q8 otherwise."""
    if x.shape[0] >= SUPERBLOCK_MIN_ROWS and qtype in SUPERBLOCK_TYPES and _superblocks[0]:
        return gguf_linear_q8k(x, panels, qtype, bias, out_features)
    return gguf_linear_q8(x, panels, qtype, bias, out_features)


def gguf_linear_dequant(x: torch.Tensor, panels: torch.Tensor, qtype: str,
                        bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    weight = _gguf_weights(panels, qtype)[:out_features].to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
