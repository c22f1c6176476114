"""What every route needs: the engine client and server options on `app.state`, the served
model's name, and the checks a request passes before it reaches the engine."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.lora_registry import LoadedLoRA
from kvserve.entrypoints.openai.errors import error_response
from kvserve.entrypoints.openai.server_config import ServerConfig


# the ASGI scope key where the API-key check names the request's tenant (several keys only)
TENANT_SCOPE_KEY = "kvserve.tenant"


def engine_of(raw: Request) -> AsyncEngine:
    return raw.app.state.engine


def config_of(raw: Request) -> ServerConfig:
    return raw.app.state.config


def model_name(raw: Request) -> str:
    """The name clients use: --served-model-name, else the model's own, else its path."""
    engine = engine_of(raw)
    info = engine.model_info()
    return config_of(raw).served_model_name or (info.name if info else engine.config.model)


def check_ready_and_model(raw: Request, requested: str | None) -> JSONResponse | None:
    """The error response for a request the engine should not see (not ready, another model,
    too many in flight), or None."""
    engine = engine_of(raw)
    if not engine.is_ready:
        return error_response(503, "the model is still loading" if engine.is_alive
                              else "the engine is not running", code="not_ready")
    if requested and requested not in (model_name(raw), engine.config.model) \
            and engine.lora(requested) is None:
        return error_response(404, f"model {requested!r} does not exist; this server "
                              f"serves {model_name(raw)!r}" + _adapters_note(engine),
                              "model", "model_not_found")
    if engine.num_unfinished >= config_of(raw).max_waiting_requests:
        return error_response(503, "too many requests in flight; retry later",
                              code="overloaded", headers={"Retry-After": "1"})
    return None


def _adapters_note(engine: AsyncEngine) -> str:
    names = [loaded.name for loaded in engine.loras()]
    return f" and the LoRA adapters {', '.join(map(repr, names))}" if names else ""


def lora_of(raw: Request, requested: str | None) -> LoadedLoRA | None:
    """The LoRA adapter a request's `model` names, if it names one (checked by
    `check_ready_and_model`)."""
    if not requested or requested in (model_name(raw), engine_of(raw).config.model):
        return None
    return engine_of(raw).lora(requested)


def served_name(raw: Request, lora: LoadedLoRA | None) -> str:
    """The `model` a response names: the adapter's, when the request ran one."""
    return lora.name if lora is not None else model_name(raw)


def cache_salt(raw: Request, requested: str | None) -> str | None:
    """The prefix-cache salt of a request: the `cache_salt` it sent, within its tenant's own
    salt where the server has one API key per tenant (so tenants never share blocks, even
    when they send the same salt)."""
    tenant = raw.scope.get(TENANT_SCOPE_KEY)
    if tenant is None:
        return requested
    return f"tenant:{tenant}\0{requested or ''}"
