"""Liveness, identity and observability routes: /health, /version, /v1/models, /metrics,
/doctor, /kv_events_info. None of them submits work to the engine."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve import __version__
from kvserve.entrypoints.openai.errors import error_response
from kvserve.entrypoints.openai.routes.lora import lora_model_cards
from kvserve.entrypoints.openai.routes.context import engine_of, model_name
from kvserve.kv_events import kv_events_info
from kvserve.metrics import DOCTOR_WINDOW_S

router = APIRouter()


@router.get("/health")
async def health(raw: Request):
    engine = engine_of(raw)
    if engine.is_ready:
        return Response(status_code=200)
    reason = "loading" if engine.is_alive else "engine not running"
    return error_response(503, reason, code="not_ready")


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/v1/models")
async def models(raw: Request):
    engine = engine_of(raw)
    info = engine.model_info()
    max_len = info.max_model_len if info else None
    created = int(time.time())
    return {"object": "list", "data": [{
        "id": model_name(raw), "object": "model", "created": created,
        "owned_by": "kvserve", "root": engine.config.model, "max_model_len": max_len},
        *lora_model_cards(raw, created, max_len)]}


@router.get("/metrics")
async def metrics(raw: Request):
    return Response(engine_of(raw).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/doctor")
async def doctor(raw: Request):
    """The bottleneck doctor's reading of the last few seconds (kvserve.bottleneck): regime,
    summary, advice and the numbers behind them."""
    metrics = engine_of(raw).metrics
    return {"model": model_name(raw), "window_s": DOCTOR_WINDOW_S,
            **metrics.diagnosis().as_dict()}


@router.get("/kv_events_info")
async def kv_events_endpoints(raw: Request):
    """Where this replica publishes its KV events, and its block size (kvserve router)."""
    engine = engine_of(raw)
    info = kv_events_info(engine.config.kv_events_config, engine.config.block_size)
    model = engine.model_info()
    info["num_kv_blocks"] = model.num_kv_blocks if model else None
    return info
