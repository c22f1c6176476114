"""Security: with --api-key every route but /health needs the key (401 otherwise, compared in
constant time); the default bind is loopback; request bodies are capped (413) even without a
Content-Length; no route serves or writes files; with a key per tenant, tenants never share
prefix-cache blocks, and `cache_salt` separates callers within one.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import psutil
import pytest
from starlette.routing import Mount

from kvserve.cli import _build_parser
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine_config import EngineConfig
from kvserve.entrypoints.openai.server import ServerConfig, build_app
from kvserve.entrypoints.openai.webui import STATIC_DIR
from kvserve.testing.server import ServerProcess
from tests.helpers import tiny_server_flags

KEY = "k3y-for-tests"
GOOD = {"Authorization": f"Bearer {KEY}"}
OTHER_TENANT = {"Authorization": "Bearer another-tenant's-key"}
BODY_LIMIT = 4096

# The whole surface. A new route must be added here on purpose (and must not touch files).
EXPECTED_ROUTES = {
    ("GET", "/health"), ("GET", "/version"), ("GET", "/v1/models"), ("GET", "/metrics"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    # the Responses API: create, and read or delete a stored response (memory, not files)
    ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    # where the engine publishes its KV events (for a router): endpoints and block size only
    ("GET", "/kv_events_info"),
    # the bottleneck doctor's reading, and the web page (its files: the one mount, below)
    ("GET", "/doctor"), ("GET", "/"),
    # FastAPI's generated docs: the schema and two HTML pages, built in memory
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
    # Anthropic's Messages API over the chat path
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
    # LoRA adapters loaded and unloaded at run time (from paths the server can read)
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    # pooling: embeddings, vLLM's pooling and scores, rerank under its three names
    ("POST", "/v1/embeddings"), ("POST", "/pooling"), ("POST", "/score"), ("POST", "/rerank"),
    ("POST", "/v1/rerank"), ("POST", "/v2/rerank"),
}


def _routes() -> set[tuple[str, str]]:
    app = build_app(AsyncEngine(EngineConfig(model="unused")), ServerConfig())
    routes = list(_flat_routes(app.routes))
    mounts = [r for r in routes if isinstance(r, Mount)]
    # the web page's own scripts and styles, from the package's static folder, are the only
    # files served (test_webui_files_stay_in_their_folder)
    assert [(m.path, Path(m.app.directory)) for m in mounts] == [("/webui", STATIC_DIR)]
    return {(method, route.path) for route in routes if not isinstance(route, Mount)
            for method in (route.methods or ()) if method != "HEAD"}


def _flat_routes(routes):
    """The app's routes with the APIRouters it includes opened (FastAPI >= 0.165 keeps an
    included router as one entry; the routers here have no prefix)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from _flat_routes(route.original_router.routes)
        else:
            yield route


def test_route_inventory_has_no_file_routes():
    assert _routes() == EXPECTED_ROUTES


def test_webui_files_stay_in_their_folder():
    from fastapi.testclient import TestClient

    app = build_app(AsyncEngine(EngineConfig(model="unused")), ServerConfig())
    with TestClient(app) as client:
        assert client.get("/webui/app.js").status_code == 200
        for escape in ("/webui/../server.py", "/webui/%2e%2e/server.py",
                       "/webui/..%2f__init__.py", "/webui//etc/passwd"):
            response = client.get(escape)
            assert response.status_code == 404 or "def " not in response.text, escape


def test_default_bind_is_loopback():
    assert ServerConfig().host == "127.0.0.1"
    assert _build_parser().parse_args(["serve"]).host == "127.0.0.1"


@pytest.fixture(scope="module")
def locked_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("locked") / "server.log"
    flags = tiny_server_flags(tiny_model_dir, "--api-key", KEY, "--api-key",
                              OTHER_TENANT["Authorization"].removeprefix("Bearer "),
                              "--max-request-body-bytes",
                              str(BODY_LIMIT), max_model_len=256)
    with ServerProcess(flags, log_path=log) as process:
        yield process
    assert process.exit_code == 0


def test_server_listens_on_loopback_only(locked_server):
    listening = [c.laddr for c in psutil.Process(locked_server.process.pid).net_connections()
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(address.ip == "127.0.0.1" for address in listening)


# public: the liveness probe, and the web page's HTML (static; every data call it makes sends
# the key, and the page says so on a 401: tests/test_webui.py)
PUBLIC_ROUTES = {("GET", "/health"), ("GET", "/")}


@pytest.mark.parametrize("method,path", sorted(EXPECTED_ROUTES - PUBLIC_ROUTES))
def test_every_route_but_health_needs_the_key(locked_server, method, path):
    """Refused without the key, however it is mangled; taken as `Authorization: Bearer` or
    as Anthropic's `x-api-key` header. The 401 is in the route's API's shape."""
    url = locked_server.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer {KEY}"},
                    {"X-API-Key": f"{KEY}x"}, {"X-API-Key": f"Bearer {KEY}"}):
        response = httpx.request(method, url, headers=headers, json={"prompt": "x"})
        assert response.status_code == 401, (path, headers)
        error = response.json()["error"]
        if path.startswith("/v1/messages"):
            assert error["type"] == "authentication_error"
        else:
            assert error["code"] == "invalid_api_key"
    for good_headers in (GOOD, {"X-API-Key": KEY}):
        good = httpx.request(method, url, headers=good_headers,
                             json={"prompt": "x", "max_tokens": 1})
        assert good.status_code != 401
        assert good.status_code < 500


def test_health_and_the_page_need_no_key(locked_server):
    assert httpx.get(locked_server.base_url + "/health").status_code == 200
    page = httpx.get(locked_server.base_url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "kvserve:" not in page.text  # the page, not the metrics it reads with the key


def test_body_limit_with_and_without_content_length(locked_server):
    url = locked_server.base_url + "/v1/completions"
    big = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'
    response = httpx.post(url, content=big, headers={**GOOD, "Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():  # a generator body is sent chunked, with no Content-Length
        for start in range(0, len(big), 1000):
            yield big[start:start + 1000]

    response = httpx.post(url, content=chunks(), headers={**GOOD,
                                                          "Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    small = httpx.post(url, content=b'{"prompt": "hi", "max_tokens": 2}', headers={
        **GOOD, "Content-Type": "application/json"})
    assert small.status_code == 200


def test_model_field_and_paths_never_reach_the_filesystem(locked_server, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    for model in (str(secret), "../../../../etc/passwd", "file:///etc/passwd"):
        response = httpx.post(locked_server.base_url + "/v1/completions", headers=GOOD,
                              json={"prompt": "x", "model": model})
        assert response.status_code == 404 and "top secret" not in response.text
    for path in ("/../../etc/passwd", "/static/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd",
                 "/docs/../../etc/passwd"):
        with socket.create_connection(("127.0.0.1", locked_server.port)) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Connection: close\r\n\r\n".encode())
            reply = b"".join(iter(lambda: sock.recv(65536), b""))
        assert b"root:" not in reply and reply.split(b" ")[1] in (b"404", b"400"), reply[:200]


def _cached_tokens(server, headers: dict, prompt: str, **fields) -> int:
    response = httpx.post(server.base_url + "/v1/completions", headers=headers, timeout=60,
                          json={"prompt": prompt, "max_tokens": 1, **fields})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_and_salts_never_share_prefix_blocks(locked_server):
    """The same prompt: the second call of a tenant hits its first call's blocks; the other
    tenant's first call, and another salt within a tenant, hit nothing; a bad salt is a 400."""
    prompt = "a prompt two tenants both send, long enough for whole blocks. " * 4
    assert _cached_tokens(locked_server, GOOD, prompt) == 0
    assert _cached_tokens(locked_server, GOOD, prompt) >= 32
    assert _cached_tokens(locked_server, OTHER_TENANT, prompt) == 0
    assert _cached_tokens(locked_server, OTHER_TENANT, prompt) >= 32
    assert _cached_tokens(locked_server, GOOD, prompt, cache_salt="user-1") == 0
    assert _cached_tokens(locked_server, GOOD, prompt, cache_salt="user-1") >= 32
    assert _cached_tokens(locked_server, OTHER_TENANT, prompt, cache_salt="user-1") == 0
    response = httpx.post(locked_server.base_url + "/v1/completions", headers=GOOD,
                          json={"prompt": prompt, "max_tokens": 1, "cache_salt": ""})
    assert response.status_code == 400 and "cache_salt" in response.text
