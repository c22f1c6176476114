"""LoRA adapters at run time, vLLM's routes: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (behind --api-key like every route). Requests then name an adapter as
their `model`; /v1/models lists each with the base as its `parent`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from kvserve.entrypoints.openai.routes.context import engine_of, model_name
from kvserve.errors import InvalidRequestError
from kvserve.lora_request import LoRARequest

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name says which


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request):
    if body.lora_name == model_name(raw):
        raise InvalidRequestError(f"{body.lora_name!r} is the base model's name",
                                  param="lora_name")
    await engine_of(raw).add_lora(LoRARequest(body.lora_name, 0, body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request):
    await engine_of(raw).remove_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def lora_model_cards(raw: Request, created: int, max_len: int | None) -> list[dict]:
    """/v1/models' entries for the loaded adapters (vLLM's shape: `parent` is the base)."""
    return [{"id": loaded.name, "object": "model", "created": created, "owned_by": "kvserve",
             "root": loaded.path, "parent": model_name(raw), "max_model_len": max_len}
            for loaded in engine_of(raw).loras()]
