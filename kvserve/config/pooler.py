"""The pooler config of a model served with `--runner pooling`: how a prompt's final hidden
states become one vector (LAST token, MEAN over the prompt, or the CLS/first token) and whether
it is L2-normalized (vLLM's PoolerConfig names).

Defaults come from the checkpoint's sentence-transformers files where it has them
(`modules.json`, the Pooling module's `config.json` in either of its formats, a Normalize
module), else LAST + normalize, the convention of decoder embedding models such as
Qwen3-Embedding. `--override-pooler-config` (or `--pooler-config`) overrides them. Torch-free:
the API front-end reads it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvserve.pooling_params import POOLING_TYPES

# sentence-transformers' pooling modes -> ours (the others have no counterpart here)
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_LEGACY_KEYS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
                   "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean"}
RUNNERS = ("auto", "generate", "pooling")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None  # a request's default dimensions (None: the hidden size)
    # the checkpoint's Matryoshka dimensions (config.json `matryoshka_dimensions`): the only
    # `dimensions` a request may ask for when listed; `allows_dimensions` False where the
    # config says `"is_matryoshka": false`
    matryoshka_dimensions: tuple[int, ...] = field(default=())
    allows_dimensions: bool = True


def parse_pooler_override(value: str | dict | None) -> dict[str, Any]:
    """`--override-pooler-config`'s JSON as the fields it overrides; ValueError naming what is
    wrong (an unknown key, an unknown pooling type)."""
    if value is None or value == "":
        return {}
    raw = json.loads(value) if isinstance(value, str) else dict(value)
    if not isinstance(raw, dict):
        raise ValueError("--override-pooler-config must be a JSON object")
    known = {"pooling_type", "normalize", "dimensions"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--override-pooler-config: {', '.join(unknown)} not supported "
                         f"(known: {', '.join(sorted(known))})")
    override = {k: v for k, v in raw.items() if v is not None}
    if "pooling_type" in override:
        kind = str(override["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"--override-pooler-config: pooling_type {kind!r} is not one of "
                             f"{', '.join(POOLING_TYPES)}")
        override["pooling_type"] = kind
    if "normalize" in override and not isinstance(override["normalize"], bool):
        raise ValueError("--override-pooler-config: normalize must be true or false")
    dims = override.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValueError("--override-pooler-config: dimensions must be a positive integer")
    return override


def resolve_pooler_config(model_dir: Path | None, override: str | dict | None = None
                          ) -> PoolerConfig:
    """The model's pooler config: its checkpoint's (a directory's sentence-transformers files
    and config.json), then `override` on top."""
    override_fields = parse_pooler_override(override)
    fields = _from_checkpoint(model_dir) if model_dir is not None and model_dir.is_dir() \
        else {}
    unserved = fields.get("pooling_type")
    if unserved not in (None, *POOLING_TYPES) and "pooling_type" not in override_fields:
        raise ValueError(f"the checkpoint's sentence-transformers pooling {unserved} is not "
                         f"served (only {', '.join(_ST_MODES)}); choose one with "
                         f"--override-pooler-config")
    return replace(PoolerConfig(**fields), **override_fields)


def _from_checkpoint(directory: Path) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    modules = _read_json(directory / "modules.json")
    if isinstance(modules, list):
        for module in modules:
            kind = str(module.get("type", ""))
            if kind.endswith(".Pooling"):
                fields["pooling_type"] = _st_pooling_type(
                    _read_json(directory / module.get("path", "") / "config.json") or {})
        fields["normalize"] = any(str(m.get("type", "")).endswith(".Normalize")
                                  for m in modules)
    hf = _read_json(directory / "config.json") or {}
    dims = hf.get("matryoshka_dimensions")
    if isinstance(dims, list):
        fields["matryoshka_dimensions"] = tuple(int(d) for d in dims)
    if hf.get("is_matryoshka") is False:
        fields["allows_dimensions"] = False
    return fields


def _st_pooling_type(pooling: dict[str, Any]) -> str:
    """A sentence-transformers Pooling module's mode as ours: `pooling_mode` (its current
    format) or the `pooling_mode_*` switches (the format most checkpoints were saved in); a
    mode served nowhere here comes back as sentence-transformers names it."""
    mode = pooling.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _ST_LEGACY_KEYS.items() if pooling.get(key)]
        mode = modes if modes else "mean"  # sentence-transformers' own default
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        return "+".join(map(str, modes))
    return _ST_MODES[modes[0]]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
