"""The model's LoRA state: a slot table (adapter id -> slot), every decoder projection's
`LinearLoRA`, and the step's row groups. The worker loads and unloads adapters as the engine
core tells it (ExecuteStep.lora_loads / lora_unloads) and sets each step's rows."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.errors import InvalidRequestError
from kvserve.models.lora.adapter import LoRAAdapter
from kvserve.models.lora.slots import LinearLoRA, LoRABatch


class ModelLoRA:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype):
        from kvserve.models.layers.decoder import DecoderModel

        self.max_loras = max_loras
        self.max_rank = max_rank
        self.batch = LoRABatch()
        self.slot_of: dict[int, int] = {}
        self._targets: dict[str, tuple[LinearLoRA, int]] = {}
        decoders = [m for m in model.modules() if isinstance(m, DecoderModel)]
        for decoder in decoders:
            decoder.lora_batch = self.batch
        ops = decoders[0].ops if decoders else None
        for module, (layer, part) in lora_targets(model).items():
            if layer.lora is None:
                layer.lora = LinearLoRA(layer, max_loras, max_rank, dtype, self.batch, ops)
            self._targets[module] = (layer.lora, part)

    def add(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Put an adapter (checked by the front-end: `check_adapter`) in a free slot."""
        if adapter_id in self.slot_of:
            return
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise InvalidRequestError(f"{self.max_loras} LoRA adapters are loaded already "
                                      "(--max-loras)", param="lora_name")
        slot = free[0]
        for lora in {id(l): l for l, _ in self._targets.values()}.values():
            lora.clear(slot)
        for module, (a, b) in adapter.weights.items():
            lora, part = self._targets[module]
            lora.set_part(slot, part, a, b)
        self.slot_of[adapter_id] = slot

    def remove(self, adapter_id: int) -> None:
        self.slot_of.pop(adapter_id, None)

    def set_rows(self, rows_by_adapter: dict[int, list[tuple[int, int]]],
                 num_rows: int) -> None:
        """This step's rows of each adapter ([start, end) spans of its num_rows flattened
        tokens); none: the step runs the base model only."""
        if not rows_by_adapter:
            self.batch.set(None)
            return
        slots = torch.full((num_rows,), -1, dtype=torch.int32)
        for adapter_id, spans in rows_by_adapter.items():
            for start, end in spans:
                slots[start:end] = self.slot_of[adapter_id]
        self.batch.set(slots)


def lora_targets(model: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """The projections an adapter may target, by checkpoint module path: (the layer, which of
    its parts). Experts (their own grouped path), embeddings and the LM head are not."""
    from kvserve.models.layers.causal_lm import module_loaders
    from kvserve.models.layers.linear import PartitionedLinear

    targets = {}
    for name, (kind, *rest) in module_loaders(model).items():
        if kind != "linear" or not name.endswith(".weight") or ".experts." in name:
            continue
        layer, part = rest[0], rest[1]
        if isinstance(layer, PartitionedLinear) and part is not None:
            targets[name.removesuffix(".weight")] = (layer, part)
    return targets


def check_adapter(targets: dict[str, tuple[nn.Module, int]], adapter: LoRAAdapter,
                  source: str) -> None:
    """An adapter every module of which the model has, with the base weight's shapes: else
    InvalidRequestError naming the first that is not."""
    for module, (a, b) in adapter.weights.items():
        target = targets.get(module)
        if target is None:
            raise InvalidRequestError(f"LoRA adapter {source}: the model has no projection "
                                      f"{module} (LoRA on MoE experts, embeddings and the LM "
                                      "head is not supported)", param="lora_path")
        layer, part = target
        rows, columns = layer.parts[part].full_rows, layer.full_in_features
        if a.shape[1] != columns or b.shape[0] != rows:
            raise InvalidRequestError(f"LoRA adapter {source}: {module} is [{b.shape[0]} x "
                                      f"{a.shape[1]}], the model's is [{rows} x {columns}]",
                                      param="lora_path")


def model_skeleton(config) -> nn.Module:
    """The family's model on the meta device (no memory): its projections' names and shapes,
    for checking an adapter in the front-end before any worker loads it."""
    from kvserve.attention import get_attention_backend
    from kvserve.models.registry import model_class_for
    from kvserve.quant import QuantPolicy

    with torch.device("meta"):
        return model_class_for(config.architecture)(
            config, get_attention_backend("torch_ref", False), None,
            QuantPolicy("none", torch.float32))
