"""Headless Chromium for the viewer tests and scripts: Debian's chromium driven by Playwright.

Never downloads a browser: it uses the one installed on the machine (``/usr/bin/chromium``, or
``TREERL_CHROMIUM``) with a fresh profile and no background networking. :func:`browser_missing`
says why no browser can run, for ``pytest.skip``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("TREERL_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def browser_missing() -> str | None:
    """Why no browser test can run here, or None when one can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install 'treerl[test]')"
    if chromium_path() is None:
        return "no chromium on this machine (apt-get install chromium, or set TREERL_CHROMIUM)"
    return None


@contextmanager
def chromium(width: int = 1400, height: int = 900):
    """A fresh headless Chromium context; yields (context, console errors list)."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="treerl-chromium-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=chromium_path(), headless=True, args=FLAGS,
                viewport={"width": width, "height": height})
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def watch(page) -> tuple[list[str], list[str]]:
    """Console errors (and page errors) and every URL the page requested, as they happen."""
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.on("request", lambda req: requests.append(req.url))
    return errors, requests


def open_view(context, url: str, timeout_ms: int = 15_000):
    """Open a treerl view page; returns (page, errors, requests, ms from navigation start to ready)."""
    page = context.new_page()
    page.set_default_timeout(timeout_ms)
    errors, requests = watch(page)
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']")
    return page, errors, requests, float(page.evaluate("TV.readyMs"))


def timed(page, action: str, arg) -> float:
    """Milliseconds the page measured for one of ``TV.timed``'s actions (``open`` a group,
    ``colour`` the tokens, ``sort`` the list), layout included."""
    return float(page.evaluate(f"(arg) => TV.timed.{action}(arg)", arg))
