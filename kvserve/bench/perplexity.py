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


def held_out_text() -> str:
    """Module and public-member docstrings, in a fixed order."""
    parts = []
    for name in HELD_OUT_MODULES:
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
