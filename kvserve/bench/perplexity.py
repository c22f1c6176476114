"""Perplexity of a model configuration on a fixed held-out text: the prose documentation
(docstrings) of a set of Python standard-library modules, disjoint from the modules the serving
workloads cut prompts from. It is how quantization modes are compared (`kvserve bench
perplexity`; `benchmarks/perplexity.py` runs every mode and writes the table).

The text is cut into non-overlapping windows; each window is one fresh sequence through the paged
model, and every position but the last predicts the next token. A window goes through in one
prefill step by default; `chunk` feeds it a few tokens per step instead, so the decode path's
few-row kernels (w4a8's integer dot products, the int4 GEMVs) compute the logits, not the
prefill's dense GEMMs.
"""

from __future__ import annotations

import importlib
import inspect
import math

import torch
import torch.nn.functional as F

HELD_OUT_MODULES = ("pathlib", "heapq", "bisect", "shutil", "tempfile", "statistics", "string",
                    "fractions", "contextlib", "enum")


# more of the same kind of text, after HELD_OUT_MODULES, for a stream longer than 16k tokens
LONG_TEXT_MODULES = HELD_OUT_MODULES + ("decimal", "datetime", "ipaddress", "difflib", "calendar",
                                        "zipfile", "tarfile", "configparser")


def held_out_text(modules: tuple[str, ...] = HELD_OUT_MODULES) -> str:
    """Module and public-member docstrings, in a fixed order."""
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for member_name in sorted(vars(module)):
            member = getattr(module, member_name)
            if member_name.startswith("_") or getattr(member, "__module__", None) != name:
                continue
            doc = inspect.getdoc(member)
            if doc:
                parts.append(f"{member_name}: {doc}")
    return "\n\n".join(p for p in parts if p)


@torch.inference_mode()
def perplexity(model, tokens: list[int], window: int = 512, windows_per_batch: int = 4,
               max_windows: int | None = None, kv_dtype: torch.dtype | None = None,
               chunk: int | None = None, bos_token_id: int | None = None) -> dict:
    """exp(mean negative log-likelihood) over every predicted position of every window.
    `chunk`: tokens per step of one window (decode-sized steps); None: whole windows, batched.
    `bos_token_id`: each window starts with it (models trained to see one, such as Gemma,
    score far worse without); it is input only, never a target."""
    from kvserve.models.paged_loop import PagedLoop

    windows = [tokens[i:i + window] for i in range(0, len(tokens) - window + 1, window)]
    if bos_token_id is not None:
        windows = [[bos_token_id] + w[:-1] for w in windows]
    windows = windows[:max_windows] if max_windows else windows
    per_batch = 1 if chunk else windows_per_batch
    loop = PagedLoop(model, per_batch, window, kv_dtype=kv_dtype)
    total_nll, count = 0.0, 0
    for start in range(0, len(windows), per_batch):
        batch = windows[start:start + per_batch]
        if chunk:
            logits = [_chunked_logits(loop, batch[0], chunk)]
        else:
            logits = loop.step(batch, [len(w) for w in batch], list(range(len(batch))),
                               all_logits=True)
        for window_logits, ids in zip(logits, batch):
            targets = torch.tensor(ids[1:])
            nll = F.cross_entropy(window_logits[:-1].float(), targets, reduction="sum")
            total_nll += float(nll)
            count += len(ids) - 1
    return {"perplexity": math.exp(total_nll / count), "tokens_scored": count,
            "windows": len(windows), "window": window}


def _chunked_logits(loop, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position of one window (sequence 0 of `loop`), `chunk` tokens a step."""
    parts = [loop.step([ids[i:i + chunk]], [min(i + chunk, len(ids))], [0], all_logits=True)[0]
             for i in range(0, len(ids), chunk)]
    return torch.cat(parts)


@torch.inference_mode()
def streaming_perplexity(model, tokens: list[int], window: int, sink_tokens: int,
                         chunk: int = 256, block_size: int = 16,
                         kv_dtype: torch.dtype | None = None) -> dict:
    """Perplexity of one long text read as one stream under the attention-sink policy
    (`--streaming-window window --streaming-sink-tokens sink_tokens`), `chunk` tokens a step:
    the engine's own KV manager evicts, the workers' StreamingKV compacts and rotates, and
    every position but the last predicts the next token. Also the most KV blocks the stream
    ever held (constant once the window is full). `kv_dtype`: the cache's (default: the
    model's)."""
    from kvserve.attention import build_attention_metadata
    from kvserve.attention.kv_tensors import allocate_kv_caches
    from kvserve.core.kv_cache.manager import KVCacheManager
    from kvserve.core.kv_cache.spec import KVCacheGroup, streaming_spec
    from kvserve.core.request import Request
    from kvserve.sampling_params import SamplingParams
    from kvserve.worker.request_state import CachedRequestState
    from kvserve.worker.streaming import StreamingKV

    config = model.config
    sink_blocks = -(-sink_tokens // block_size)
    spec = streaming_spec(block_size, window, sink_blocks)
    num_blocks = spec.max_cached_tokens(chunk) // block_size + 1  # + the null block
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, groups=(
        KVCacheGroup(spec, tuple(range(config.num_hidden_layers))),))
    parameter = next(model.parameters())
    model.bind_kv_cache(allocate_kv_caches(model.kv_page_layouts(kv_dtype or parameter.dtype),
                                           num_blocks, block_size, parameter.device))
    params = SamplingParams(max_tokens=1)
    request = Request("stream", tokens, params, max_tokens=1)
    state = CachedRequestState("stream", tokens, params)
    streaming = StreamingKV(model, block_size, sink_blocks)
    total_nll, most_blocks = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        count = min(chunk, len(tokens) - 1 - start)
        if not kv.allocate_slots(request, count):
            raise RuntimeError("the streaming cache outgrew its bound")
        most_blocks = max(most_blocks, kv.num_held_blocks("stream"))
        table, cache_start = streaming.view(state, kv.block_ids("stream"), start)
        metadata, positions = build_attention_metadata([count], [cache_start + count], [table],
                                                       block_size, parameter.device)
        ids = torch.tensor(tokens[start:start + count], device=parameter.device)
        logits = model.compute_logits(model(ids, positions, metadata))
        targets = torch.tensor(tokens[start + 1:start + count + 1], device=parameter.device)
        total_nll += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        request.num_computed_tokens += count
        kv.release_unneeded(request)
    scored = len(tokens) - 1
    return {"perplexity": math.exp(total_nll / scored), "tokens_scored": scored,
            "window": window, "sink_tokens": sink_blocks * block_size, "chunk": chunk,
            "max_kv_blocks": most_blocks, "max_kv_tokens": most_blocks * block_size}


@torch.inference_mode()
def strided_perplexity(model, tokens: list[int], context: int, stride: int = 256,
                       start: int = 0) -> dict:
    """The in-window reference: each scored token sees `context` to `context + stride`
    preceding tokens with full attention, recomputed window by window (the "sliding window
    with re-computation" of the StreamingLLM paper, strided). Scores tokens from `start`."""
    from kvserve.models.paged_loop import PagedLoop

    loop = PagedLoop(model, 1, context + stride)
    total_nll = 0.0
    for scored_to in range(start, len(tokens) - 1, stride):
        end = min(scored_to + stride, len(tokens) - 1)  # targets tokens[scored_to + 1:end + 1]
        ids = tokens[max(0, scored_to + 1 - context):end]
        logits = loop.step([ids], [len(ids)], [0], all_logits=True)[0]
        targets = torch.tensor(tokens[scored_to + 1:end + 1])
        total_nll += float(F.cross_entropy(logits[-len(targets):].float(), targets,
                                           reduction="sum"))
    scored = len(tokens) - 1 - start
    return {"perplexity": math.exp(total_nll / scored), "tokens_scored": scored,
            "context": context, "stride": stride}
