"""The front-end's LoRA adapters: name -> this load's id and path.

An adapter is checked here, against the model's projections (a meta-device skeleton: names
and shapes, no memory), before the core hears of it, so a bad adapter is a 400 and never
reaches a worker. Each load gets a new id, never reused, and an adapter's requests carry a
cache salt made from it: two adapters, or an adapter and the base, never share a KV block,
in the prefix cache, the offload tiers or the router's view (all key blocks by salted hash).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from kvserve.engine_config import EngineConfig
from kvserve.errors import InvalidRequestError, LoRANotFoundError
from kvserve.lora_request import LoRARequest


@dataclass(frozen=True)
class LoadedLoRA:
    name: str
    lora_id: int
    path: str


class LoRARegistry:
    def __init__(self, config: EngineConfig, model_config, core):
        self.enabled = config.enable_lora
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self._model_config = model_config
        self._core = core
        self._targets = None  # built at the first load
        self._loaded: dict[str, LoadedLoRA] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, request: LoRARequest) -> LoadedLoRA:
        """Load an adapter (a name already loaded from the same path is kept as is)."""
        if not self.enabled:
            raise InvalidRequestError("LoRA adapters need a server started with --enable-lora",
                                      param="lora_name")
        with self._lock:
            known = self._loaded.get(request.lora_name)
            if known is not None:
                if known.path != request.lora_path:
                    raise InvalidRequestError(f"a LoRA adapter named {request.lora_name!r} is "
                                              "loaded already", param="lora_name")
                return known
            if len(self._loaded) >= self.max_loras:
                raise InvalidRequestError(f"{self.max_loras} LoRA adapters are loaded already "
                                          "(--max-loras); unload one first", param="lora_name")
            self._check(request.lora_path)
            loaded = LoadedLoRA(request.lora_name, next(self._ids), request.lora_path)
            self._core.call_utility("add_lora", loaded.lora_id, loaded.path)
            self._loaded[loaded.name] = loaded
            return loaded

    def remove(self, name: str) -> None:
        """New requests can no longer name it; those running finish on it, then the workers
        free its slot."""
        with self._lock:
            loaded = self._loaded.pop(name, None)
            if loaded is None:
                raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded",
                                        param="lora_name")
            self._core.call_utility("remove_lora", loaded.lora_id)

    def get(self, name: str) -> LoadedLoRA:
        loaded = self._loaded.get(name)
        if loaded is None:
            raise LoRANotFoundError(f"the model {name!r} does not exist (no LoRA adapter of "
                                    "that name is loaded)", param="model")
        return loaded

    def is_loaded(self, lora_id: int) -> bool:
        return any(loaded.lora_id == lora_id for loaded in list(self._loaded.values()))

    def loaded(self) -> list[LoadedLoRA]:
        return list(self._loaded.values())

    def _check(self, path: str) -> None:
        from kvserve.models.lora.adapter import read_peft_adapter
        from kvserve.models.lora.model_lora import check_adapter, lora_targets, model_skeleton

        adapter = read_peft_adapter(path, self.max_rank, header_only=True)
        if self._targets is None:
            self._targets = lora_targets(model_skeleton(self._model_config))
        check_adapter(self._targets, adapter, path)


def salted(cache_salt: str | None, loaded: LoadedLoRA | None) -> str | None:
    """The request's cache salt with its adapter's load in it."""
    if loaded is None:
        return cache_salt
    mark = f"lora:{loaded.lora_id}:{loaded.name}"
    return mark if cache_salt is None else f"{mark}/{cache_salt}"
