"""The documentation site builds in strict mode (a broken link, a missing page or anchor fails), and its reference
pages, generated from the code, name every command, tunable, exit status, store array and extra."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from daskgen.exit_codes import MEANINGS, ExitCode
from daskgen.store.layout import every_array_layout
from daskgen.tunables import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def page_text(site: Path, page: str) -> str:
    body = (site / page / "index.html").read_text()
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def flat_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        keys += flat_keys(value, path) if isinstance(value, dict) and value else [path]
    return keys


def test_every_command_is_on_the_command_line_page(site: Path) -> None:
    import typer

    from daskgen.cli import app

    text = page_text(site, "reference/cli")
    for name in typer.main.get_command(app).commands:  # type: ignore[attr-defined]
        assert f"daskgen {name}" in text, name
    assert "--max-new-tokens" in text and "--retry-failed" in text


def test_every_tunable_is_on_its_page_with_its_default_and_a_description(site: Path) -> None:
    text = page_text(site, "reference/tunables")
    rows = dict(re.findall(r"\n\s*(daskgen\.[\w.-]+)\s*\n\s*([^\n]+)\n", text))
    keys = flat_keys(DEFAULTS)
    assert keys and set(keys) <= set(rows), sorted(set(keys) - set(rows))
    table = (site / "reference" / "tunables" / "index.html").read_text()
    undescribed = [
        key
        for key in keys
        if re.search(rf"<code>{re.escape(key)}</code></td>\s*<td>[^<]*<code>[^<]*</code></td>\s*<td></td>", table)
    ]
    assert not undescribed, f"tunables without a description in daskgen.yaml: {undescribed}"


def test_every_exit_status_is_on_its_page(site: Path) -> None:
    text = page_text(site, "reference/exit-codes")
    assert set(MEANINGS) == set(ExitCode)
    for code in ExitCode:
        squeezed, meaning = re.sub(r"\s+", "", text), re.sub(r"[\s`]+", "", MEANINGS[code])
        assert code.name in text and meaning in squeezed, code


def test_every_store_array_is_on_the_layout_page(site: Path) -> None:
    text = page_text(site, "reference/store-layout")
    for name in every_array_layout(("{name}",)).array_specs():
        assert name in text, name


def test_every_extra_is_on_its_page_and_the_api_page_has_the_entry_points(site: Path) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = page_text(site, "reference/extras")
    assert all(name in text for name in extras)
    api = (site / "reference" / "api" / "index.html").read_text()  # each entry rendered from its docstring
    for path in (
        "client.runner.generate",
        "stream.follow",
        "store.tools.verify.verify",
        "analysis.accessor.open_store",
        "store.policy.publish_policy",
        "analysis.export.export",
        "analysis.accessor.DaskgenAccessor",
    ):
        assert f'id="daskgen.{path}"' in api, f"daskgen.{path} is not rendered on the API page"


def test_the_command_line_exits_only_with_statuses_of_the_table() -> None:
    """The table is complete: the CLI's own exits name an ExitCode, never a bare number."""
    source = (ROOT / "daskgen" / "cli.py").read_text()
    exits = re.findall(r"(?:sys\.exit|typer\.Exit)\(([^()]*(?:\([^()]*\))?[^()]*)\)", source)
    assert exits, "no exits found: the pattern no longer matches daskgen/cli.py"
    bare = [call for call in exits if re.search(r"(?<![\w.])\d+(?![\w.])", call)]
    assert not bare, f"exit statuses given as numbers in daskgen/cli.py: {bare}"
