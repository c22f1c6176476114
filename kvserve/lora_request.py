"""`LoRARequest`, vLLM's: which adapter a request runs (offline, `LLM.generate(...,
lora_request=)`; over HTTP a request's `model` names it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: what requests and /v1/models call it; `lora_int_id`: vLLM's numeric id
    (kept for compatibility: kvserve keys adapters by name and numbers each load itself, so an
    adapter loaded again never meets blocks cached under its previous load);
    `lora_path`: the PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str
