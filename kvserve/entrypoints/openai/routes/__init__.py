"""The server's routes, one APIRouter per concern; `ROUTERS` is what `build_app` includes.

Routes reach the engine only through its typed client API (`AsyncEngine`), found with the
server's options on `app.state` (see `context`).
"""

from kvserve.entrypoints.openai.routes import (
    generation,
    health,
    lora,
    messages,
    pooling,
    responses,
    tokenization,
)

ROUTERS = (health.router, tokenization.router, generation.router, responses.router,
           messages.router, lora.router,
           pooling.router)
