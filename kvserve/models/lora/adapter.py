"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`), read
into per-module (A, B) pairs with the scaling folded into B, or refused with a clear error for
what it asks that kvserve does not apply (DoRA, trained biases, extra trained modules,
per-module ranks), so an adapter never silently changes into another."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAAdapter:
    """`weights`: module path (the base checkpoint's, e.g. "model.layers.0.self_attn.q_proj")
    -> (A [rank, in], B [out, rank] times the scaling), float32."""

    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_peft_adapter(path: str | Path, max_rank: int, header_only: bool = False
                      ) -> LoRAAdapter:
    """The adapter at `path`; InvalidRequestError naming the problem when it cannot be
    applied as it was trained. `header_only`: shapes right but no weights read (the front-end's
    check before any worker loads it)."""
    directory = Path(path)
    config = _read_config(directory)
    rank = int(config.get("r", 0))
    if not 0 < rank <= max_rank:
        raise InvalidRequestError(f"LoRA adapter {directory}: rank {rank} exceeds "
                                  f"--max-lora-rank {max_rank}" if rank > max_rank else
                                  f"LoRA adapter {directory}: rank {rank} is not positive",
                                  param="lora_path")
    _refuse_unsupported(directory, config)
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = _read_tensors(directory, header_only)
    return LoRAAdapter(rank, _pairs(directory, tensors, scaling))


def _read_config(directory: Path) -> dict:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise InvalidRequestError(f"LoRA adapter {directory}: no {CONFIG_FILE} (a PEFT adapter "
                                  "directory holds one)", param="lora_path")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"LoRA adapter {directory}: {CONFIG_FILE} does not read: "
                                  f"{exc}", param="lora_path") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError(f"LoRA adapter {directory}: peft_type "
                                  f"{config.get('peft_type')!r} is not LORA", param="lora_path")
    return config


def _refuse_unsupported(directory: Path, config: dict) -> None:
    problems = {
        "use_dora": "DoRA adapters are not supported",
        "bias": "trained LoRA biases are not supported",
        "modules_to_save": "adapters that also train whole modules are not supported",
        "rank_pattern": "per-module ranks are not supported",
        "alpha_pattern": "per-module alphas are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters are not supported",
        "layer_replication": "layer replication is not supported",
    }
    for key, message in problems.items():
        value = config.get(key)
        if value not in (None, False, "none", {}, []):
            raise InvalidRequestError(f"LoRA adapter {directory}: {message} ({key}: {value!r})",
                                      param="lora_path")


def _read_tensors(directory: Path, header_only: bool) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                return _safetensors(file, header_only)
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a corrupt file is the adapter's problem, not the engine's
            raise InvalidRequestError(f"LoRA adapter {directory}: {name} does not read: {exc}",
                                      param="lora_path") from exc
    raise InvalidRequestError(f"LoRA adapter {directory}: no {' or '.join(WEIGHT_FILES)}",
                              param="lora_path")


def _safetensors(file: Path, header_only: bool) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        if header_only:  # shapes only: empty tensors of the stored shapes
            return {key: torch.empty(handle.get_slice(key).get_shape(), device="meta")
                    for key in handle.keys()}
        return {key: handle.get_tensor(key) for key in handle.keys()}


def _pairs(directory: Path, tensors: dict[str, torch.Tensor], scaling: float
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, which = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if which not in ("A.weight", "B.weight"):
            raise InvalidRequestError(f"LoRA adapter {directory}: tensor {key!r} is not a "
                                      "LoRA A or B weight (embedding LoRA and other kinds are "
                                      "not supported)", param="lora_path")
        halves.setdefault(module, {})[which[0]] = tensor
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"A", "B"} or half["A"].shape[0] != half["B"].shape[1]:
            raise InvalidRequestError(f"LoRA adapter {directory}: module {module} lacks a "
                                      "matching A and B", param="lora_path")
        a, b = half["A"], half["B"]
        if a.device.type != "meta":
            a, b = a.float(), b.float() * scaling
        pairs[module] = (a, b)
    return pairs
