"""The headless Chromium the page tests drive through Playwright, and the folder their screenshots go to. Importing
this module skips the importing test module where Chromium or Playwright is missing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)", allow_module_level=True)
sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright


@contextmanager
def headless_page(width_px: int, height_px: int) -> Iterator[Any]:
    """A Playwright page of a new headless Chromium with a `width_px` x `height_px` viewport; the browser is closed
    on exit. Creates ARTIFACTS for the caller's screenshots."""
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width_px, "height": height_px})
        finally:
            browser.close()
