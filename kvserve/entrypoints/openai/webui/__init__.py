"""The web page at `/`: a streaming chat and a live dashboard, plain HTML, JS and CSS served
from `static/` (no build step, no network at run time), for `kvserve serve` and `kvserve router`.

The page and its files are public even when --api-key is set (they hold no data); every call
the page makes (chat, /v1/models, /metrics, /doctor) carries the key the user enters.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
ASSETS_PREFIX = "/webui/"


def is_webui_path(path: str) -> bool:
    """The page or one of its files: what a browser fetches before it has a key."""
    return path == "/" or path.startswith(ASSETS_PREFIX)


# revalidated on each load (a 304 when unchanged), so a browser never runs an older kvserve's
# scripts against a newer server
_REVALIDATE = {"Cache-Control": "no-cache"}


class _Assets(StaticFiles):
    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(_REVALIDATE)
        return response


def install_webui(app: FastAPI) -> None:
    """`/` answers the page, `/webui/...` its scripts and styles."""

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC_DIR / "index.html", headers=_REVALIDATE)

    app.mount(ASSETS_PREFIX.rstrip("/"), _Assets(directory=STATIC_DIR), name="webui")
