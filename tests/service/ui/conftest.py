"""The browser the UI tests drive: Debian's Chromium through Playwright, one tab per test that records what must never
happen (script errors, CSP refusals, missing files)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
#: the screenshots each run leaves, committed so a change of a page shows in review
SCREENSHOTS = Path(__file__).parents[2] / "screenshots"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium); the browser "
                    "tests need it and do not skip", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: pip install -e '.[dev]'", pytrace=False)
    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield chromium
        chromium.close()


class Page:
    """A fresh browser tab that records what must never happen: script errors, CSP refusals, missing files."""

    def __init__(self, browser: Any, base_url: str) -> None:
        self.context = browser.new_context(base_url=base_url, viewport={"width": 1280, "height": 900},
                                           accept_downloads=True)
        self.page = self.context.new_page()
        self.page.set_default_timeout(15_000)
        self.problems: list[str] = []
        self.page.on("pageerror", lambda exc: self.problems.append(f"script error: {exc}"))
        self.page.on("console", self._console)
        self.page.on("response", self._response)
        self.page.on("dialog", lambda dialog: dialog.accept())

    def _console(self, message: Any) -> None:
        if message.type == "error" and ("Content Security Policy" in message.text or "Alpine" in message.text):
            self.problems.append(f"console: {message.text}")

    def _response(self, response: Any) -> None:
        if response.request.method == "GET" and "/ui/" in response.url and response.status >= 400:
            self.problems.append(f"{response.status} for {response.url}")

    def screenshot(self, name: str) -> None:
        # from the top: a page scrolled to an anchor draws its sticky table headers over rows in a full-page shot
        self.page.evaluate("window.scrollTo(0, 0)")
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()
        assert not self.problems, self.problems


@pytest.fixture
def tab(browser) -> Iterator[Any]:
    tabs: list[Page] = []

    def open_tab(base_url: str) -> Page:
        tabs.append(Page(browser, base_url))
        return tabs[-1]

    yield open_tab
    for opened in tabs:
        opened.close()
