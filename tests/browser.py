"""A headless Chromium for tests that look at a page as a person would (Debian's ``chromium`` and
``chromium-driver``, driven by selenium), and where its screenshots go.

Screenshots are test artifacts: they go to ``$DASKGEN_TEST_ARTIFACTS`` (created if needed) or, when
that is not set, to the test's temporary folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: Environment variable naming the folder that keeps screenshots.
ARTIFACTS_ENV = "DASKGEN_TEST_ARTIFACTS"

#: Reads every element with a ``data-daskgen`` attribute, also inside Bokeh's shadow roots.
_READ_VALUES = """
const out = {};
function walk(root) {
  for (const el of root.querySelectorAll('[data-daskgen]')) out[el.dataset.daskgen] = el.textContent;
  for (const el of root.querySelectorAll('*')) if (el.shadowRoot) walk(el.shadowRoot);
}
walk(document);
return out;
"""


def artifacts_dir(tmp_path: Path) -> Path:
    """Where screenshots go: ``$DASKGEN_TEST_ARTIFACTS`` or ``tmp_path``."""
    folder = Path(os.environ.get(ARTIFACTS_ENV) or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def chromium(width: int = 1600, height: int = 1250) -> Iterator[Any]:
    """A headless Chromium (the system's browser and driver; nothing is downloaded)."""
    # plain imports, inside: the sglang/vllm lanes collect tests/test_dashboard.py without selenium installed
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def shown_values(driver: Any) -> dict[str, str]:
    """The page's ``data-daskgen`` values as displayed (text)."""
    return driver.execute_script(_READ_VALUES)


def wait_until_shown(driver: Any, check: Callable[[dict[str, str]], bool], timeout: float = 60.0) -> dict[str, str]:
    """Poll the displayed values until ``check`` accepts them; the values."""
    deadline = time.monotonic() + timeout
    values: dict[str, str] = {}
    while time.monotonic() < deadline:
        values = shown_values(driver)
        if values and check(values):
            return values
        time.sleep(0.3)
    raise AssertionError(f"the page never showed what was expected within {timeout} s; it shows {values}")


def number(text: str) -> float:
    """A displayed number (``"1,234"`` -> 1234.0)."""
    return float(text.replace(",", "").rstrip("%"))
