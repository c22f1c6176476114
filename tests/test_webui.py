"""The web page at / (chat and dashboard), driven in headless Chromium through Playwright.

Debian's `chromium` is the browser (`make install` adds it where it can; Playwright's own
download is not used). One tiny-model server with --api-key serves the page tests, and a
router in front of it the router's; --no-webui is checked on the server's own app.
"""

from __future__ import annotations

import shutil

import httpx
import pytest

from kvserve.testing.server import ServerProcess
from tests.helpers import finished_count, read_metrics, tiny_server_flags, wait_until

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="the `playwright` package is missing (pip install "
    "'kvserve[dev]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no `chromium` executable on PATH (Debian: apt-get install chromium; "
                "`make install` does it as root)", allow_module_level=True)

KEY = "webui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
PROMPT = "Tell me a story about a cat"
MAX_TOKENS = 12

# every text the assistant's answer held, in order (each delta replaces the text node)
RECORD_ANSWER_TEXTS = """() => {
  window.answerTexts = [];
  new MutationObserver((records) => {
    for (const record of records) {
      if (!record.target.closest?.(".message.assistant .content")) continue;
      for (const node of record.addedNodes) if (node.nodeType === 3) window.answerTexts.push(node.data);
    }
  }).observe(document.getElementById("messages"), {childList: true, subtree: true});
}"""


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("webui") / "server.log"
    flags = tiny_server_flags(tiny_model_dir, "--api-key", KEY, "--served-model-name", MODEL)
    with ServerProcess(flags, log_path=log) as process:
        yield process


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        # --no-sandbox: Chromium's sandbox refuses to run as root (CI containers)
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()  # a fresh sessionStorage: no key yet
    yield context.new_page()
    context.close()


def use_key(page) -> None:
    page.fill("#api-key", KEY)
    page.click("text=Use key")
    page.wait_for_selector(f"#model option[value='{MODEL}']", state="attached")


def chat(page, prompt: str, max_tokens: int) -> str:
    """Sends a greedy chat from the page and waits for its answer (and the note under it)."""
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    page.wait_for_selector(".message.assistant small:not(:empty)")
    note = page.text_content(".message.assistant small")
    assert not note.startswith("error"), note
    return page.text_content(".message.assistant .content")


def api_answer(base_url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": max_tokens}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, headers=AUTH,
                          timeout=60)
    response.raise_for_status()
    return response.json()


def wait_for_text(page, selector: str, expected: str, timeout: float = 10.0) -> None:
    wait_until(lambda: page.text_content(selector) == expected, timeout,
               f"{selector} to read {expected!r} (it reads {page.text_content(selector)!r})")


def test_page_asks_for_the_key_then_streams_a_chat_and_updates_the_dashboard(server, page):
    assert httpx.get(server.base_url + "/metrics").status_code == 401  # still behind the key
    page.goto(server.base_url)  # the page itself needs no key; its data calls do
    page.wait_for_selector("#status:not([hidden])")
    assert "401" in page.text_content("#status") and "API key" in page.text_content("#status")
    use_key(page)
    page.wait_for_selector("#status", state="hidden")
    wait_for_text(page, "#m-tokens", "0")
    page.evaluate(RECORD_ANSWER_TEXTS)

    answer = chat(page, PROMPT, MAX_TOKENS)

    expected = api_answer(server.base_url, PROMPT, MAX_TOKENS)
    assert expected["usage"]["completion_tokens"] > 1
    assert answer == expected["choices"][0]["message"]["content"]
    texts = page.evaluate("window.answerTexts")
    assert len(set(texts)) > 1, texts  # token by token, not one update at the end
    assert texts[-1] == answer and all(answer.startswith(text) for text in texts), texts
    metrics = read_metrics(server.base_url, AUTH)
    wait_for_text(page, "#m-tokens", str(round(metrics["kvserve:generation_tokens_total"])))
    wait_for_text(page, "#m-requests", str(round(finished_count(metrics))))
    assert "samples since start" in page.text_content("#ttft-caption")
    assert_regime_and_doctor(server.base_url, page)


def assert_regime_and_doctor(base_url: str, page) -> None:
    """The regime tile reads the bottleneck_regime gauge (n/a without one); the doctor's summary
    shows where /doctor answers."""
    metrics = httpx.get(base_url + "/metrics", headers=AUTH).text
    active = [line for line in metrics.splitlines()
              if line.startswith("kvserve:bottleneck_regime{") and line.endswith(" 1.0")]
    regime = active[0].split('regime="')[1].split('"')[0] if active else "n/a"
    wait_for_text(page, "#m-regime", regime)
    doctor = httpx.get(base_url + "/doctor", headers=AUTH)
    if doctor.status_code == 200:
        wait_until(lambda: doctor.json()["summary"] in (page.text_content("#doctor") or ""),
                   10.0, "the doctor's summary on the page")
    else:
        assert page.locator("#doctor").is_hidden()


def test_a_wrong_key_shows_the_401_message(server, page):
    page.goto(server.base_url)
    page.fill("#api-key", "not-the-key")
    page.click("text=Use key")
    page.fill("#prompt", "hello")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".message.assistant small:not(:empty)")
    assert "401" in page.text_content(".message.assistant small")
    assert "API key" in page.text_content("#status")


def test_no_webui_turns_the_page_off():
    from kvserve.cli import _build_parser
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine_config import EngineConfig
    from kvserve.entrypoints.cli_args import dataclass_from_args
    from kvserve.entrypoints.openai.server import ServerConfig, build_app
    from starlette.testclient import TestClient

    def status(flags: list[str], path: str) -> int:
        config = dataclass_from_args(ServerConfig, _build_parser().parse_args(["serve", *flags]))
        # TestClient: its own thread's loop (Playwright's sync API holds this thread's)
        client = TestClient(build_app(AsyncEngine(EngineConfig(model="unused")), config))
        return client.get(path).status_code

    assert status([], "/") == 200
    assert status([], "/webui/app.js") == 200
    assert status(["--no-webui"], "/") == 404
    assert status(["--no-webui"], "/webui/app.js") == 404
    # without the page its files are not public either: the key is asked for first
    assert status(["--no-webui", "--api-key", "k"], "/webui/app.js") == 401


def test_the_router_serves_the_page_with_its_own_metrics(server, tiny_model_dir, page,
                                                         tmp_path_factory):
    log = tmp_path_factory.mktemp("webui-router") / "router.log"
    flags = ["--replica", server.base_url, "--replica-api-key", KEY, "--model",
             str(tiny_model_dir), "--policy", "round-robin"]
    with ServerProcess(flags, log_path=log, subcommand="router") as router:
        page.goto(router.base_url)
        use_key(page)  # forwarded to the replica, which asks for it
        wait_for_text(page, "#r-healthy", "1 of 1")
        assert page.locator("#engine-tiles").is_hidden()
        answer = chat(page, PROMPT, MAX_TOKENS)
        assert answer == api_answer(server.base_url, PROMPT, MAX_TOKENS)["choices"][0][
            "message"]["content"]
        wait_for_text(page, "#r-requests", "1")
