"""Takes docs/webui.png: the web page of a `kvserve serve` after a short chat, in headless
Chromium (Debian's `chromium`, driven by Playwright).

    .venv/bin/python tools/webui_screenshot.py [--model smollm2-135m-instruct] [--out PATH]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from playwright.sync_api import sync_playwright

from kvserve.testing.server import ServerProcess

QUESTIONS = ("What is a KV cache, in two sentences?", "And why does prefix caching help?")


def chat(page, question: str) -> None:
    answers = page.locator(".message.assistant small:not(:empty)").count()
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        f"document.querySelectorAll('.message.assistant small:not(:empty)').length > {answers}",
        timeout=120_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "docs" / "webui.png"))
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    with ServerProcess(["--model", args.model, "--max-model-len", "2048"]) as server, \
            sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(server.base_url)
        page.fill("#temperature", "0.3")
        page.fill("#max-tokens", "96")
        for question in QUESTIONS:
            chat(page, question)
        page.wait_for_timeout(2500)  # two more dashboard polls
        page.screenshot(path=args.out)
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
