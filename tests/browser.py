"""A headless Chromium for tests that look at a page as a person would (Debian's ``chromium`` and
``chromium-driver``, driven by selenium): the numbers and the Bokeh data sources it shows, its console
errors, and where its screenshots go.

Screenshots are kept as test artifacts: in ``$DASKGEN_TEST_ARTIFACTS`` or, when that is not set, in
``artifacts/dashboard/`` of the repository (created if needed, ignored by git).
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
#: Where screenshots go without it.
DEFAULT_ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "dashboard"

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

#: The ``data`` of the Bokeh document's ColumnDataSources named in ``arguments[0]`` (columns as plain arrays).
_READ_SOURCES = """
const doc = Bokeh.documents[0], out = {};
if (doc === undefined) return out;
for (const name of arguments[0]) {
  const source = doc.get_model_by_name(name);
  if (source === null) continue;
  out[name] = {};
  for (const [column, values] of Object.entries(source.data)) out[name][column] = Array.from(values);
}
return out;
"""

#: Per data source name in ``arguments[0]``: the boxes of the figures whose glyphs draw it, in device pixels.
_FIGURE_BOXES = """
const names = arguments[0], out = {}, ratio = window.devicePixelRatio || 1;
function walk(view) {
  const renderers = view.model.renderers ?? [];
  for (const name of names) {
    if (view.model.type === 'Figure' && renderers.some((r) => r.data_source && r.data_source.name === name)) {
      const r = view.el.getBoundingClientRect();
      (out[name] ??= []).push([r.left, r.top, r.right, r.bottom].map((v) => Math.round(v * ratio)));
    }
  }
  for (const child of view.child_views ?? []) walk(child);
}
for (const root of Bokeh.index.roots) walk(root);
return out;
"""


def artifacts_dir() -> Path:
    """Where screenshots are kept: ``$DASKGEN_TEST_ARTIFACTS`` or :data:`DEFAULT_ARTIFACTS`."""
    folder = Path(os.environ.get(ARTIFACTS_ENV) or DEFAULT_ARTIFACTS)
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
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for severe_console_errors
    service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def open_page(driver: Any, url: str) -> None:
    """Load ``url`` after leaving the page open before and forgetting its console messages (so
    :func:`severe_console_errors` reports this page's only)."""
    driver.get("about:blank")
    driver.get_log("browser")
    driver.get(url)


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


def bokeh_sources(driver: Any, *names: str) -> dict[str, dict[str, list[Any]]]:
    """The columns of the page's Bokeh data sources called ``names``, as the browser holds them (a name the
    document does not have yet is left out)."""
    return driver.execute_script(_READ_SOURCES, list(names))


def wait_for_sources(
    driver: Any, names: tuple[str, ...], check: Callable[[dict[str, dict[str, list[Any]]]], bool], timeout: float = 60.0
) -> dict[str, dict[str, list[Any]]]:
    """Poll :func:`bokeh_sources` until every one of ``names`` is there and ``check`` accepts them; the sources."""
    deadline = time.monotonic() + timeout
    sources: dict[str, dict[str, list[Any]]] = {}
    while time.monotonic() < deadline:
        sources = bokeh_sources(driver, *names)
        if len(sources) == len(names) and check(sources):
            return sources
        time.sleep(0.3)
    raise AssertionError(f"the page's data sources never matched within {timeout} s; they hold {sources}")


def severe_console_errors(driver: Any) -> list[str]:
    """Messages the page logged to the browser console at level SEVERE since the last call (errors,
    uncaught exceptions, failed loads)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


Box = tuple[int, int, int, int]


def figure_boxes(driver: Any, *names: str) -> dict[str, list[Box]]:
    """Where the page draws the figures of the data sources called ``names``: per source, the
    ``(left, top, right, bottom)`` of each figure that draws it, in screenshot pixels (a source no figure
    draws yet is left out)."""
    found = driver.execute_script(_FIGURE_BOXES, list(names))
    return {name: [(b[0], b[1], b[2], b[3]) for b in boxes] for name, boxes in found.items()}


def screenshot(driver: Any, path: Path) -> Path:
    """Save the page (its window) as a PNG at ``path``."""
    assert driver.save_screenshot(str(path)), f"no screenshot written to {path}"
    return path


def colours(path: Path, boxes: list[Box] | None = None) -> set[tuple[int, int, int]]:
    """The colours of a saved screenshot (inside ``boxes``, when given), read back from the file."""
    from PIL import Image

    with Image.open(path) as image:
        whole = image.convert("RGB")
    found: set[tuple[int, int, int]] = set()
    for part in [whole] if boxes is None else [whole.crop(box) for box in boxes]:
        found.update(rgb for _, rgb in part.getcolors(maxcolors=part.width * part.height) or [])
    return found


def rgb(hex_colour: str) -> tuple[int, int, int]:
    """``"#1565c0"`` -> ``(21, 101, 192)``."""
    value = hex_colour.lstrip("#")
    return int(value[0:2], 16), int(value[2:4], 16), int(value[4:6], 16)
