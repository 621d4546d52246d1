"""A real headless Chromium driven through Selenium: Debian's `chromium` and `chromium-driver`
(`make browser` installs them), never a browser or driver downloaded at run time. What a page
logged to its console and every URL it requested come from Chrome's own logs."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"  # screenshots; gitignored
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install chromium chromium-driver (or `make browser`)"


def find_browser() -> tuple[str, str] | None:
    """(browser, driver) paths, or None."""
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextmanager
def chromium(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A headless Chromium session, or a skipped test saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (it is in the `test` extra)")
    found = find_browser()
    if found is None:
        pytest.skip(f"no Chromium and chromedriver on PATH: {INSTALL}")
    browser, driver_path = found
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",  # no update or safe-browsing requests of its own
        "--disable-component-update",
        "--disable-sync",
        "--disable-features=Translate,OptimizationHints,MediaRouter",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except WebDriverException as e:
        pytest.skip(f"Chromium did not start ({browser}, {driver_path}): {e.msg}")
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """Console messages at error level since the last call (the log is drained by reading it)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def requested_urls(driver: Any) -> list[str]:
    """Every URL the browser asked for since the last call, from Chrome's network events."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def offsite(urls: list[str], base: str) -> list[str]:
    """The URLs that leave BASE (data: and blob: URLs are made in the page)."""
    return [u for u in urls if not u.startswith((base + "/", "data:", "blob:"))]


def wait_for(check: Callable[[], Any], seconds: float = 60, what: str = "the page") -> Any:
    deadline = time.time() + seconds
    while True:
        value = check()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path
