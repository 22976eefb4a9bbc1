"""The package's metadata: its license, the same dependencies in pyproject.toml and environment.yml, and what mypy
checks."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
# pip names whose conda-forge package is called otherwise
CONDA_NAMES = {"torch": "pytorch", "ray": "ray-core", "types-pyyaml": "types-pyyaml", "moto[server]": "moto"}
# extras installed from pip on GPU nodes only (environment.yml's header says how), and dask's own extra
PIP_ONLY = {"sglang", "vllm"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(spec: str) -> tuple[str, str]:
    """Split ``name[extra]>=1.0,<2`` into a lower-cased conda-style name and its version bounds."""
    match = re.match(r"^([A-Za-z0-9_.\-]+(?:\[[a-z,]+\])?)\s*(.*)$", spec.strip())
    assert match, spec
    name = match.group(1).lower()
    return CONDA_NAMES.get(name, name), match.group(2).replace(" ", "")


def test_the_license_file_is_the_one_pyproject_declares() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "Copyright 2026 The daskgen authors" in text


def test_every_dependency_is_in_environment_yml_with_the_same_bounds() -> None:
    project = _pyproject()["project"]
    specs = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        specs += [item for item in items if not item.startswith("daskgen[") and extra not in PIP_ONLY]
    conda = {}
    for entry in yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]:
        if isinstance(entry, str):
            name, bounds = _requirement(entry.split("=", 1)[0] if "python=" in entry else entry)
            conda[name] = bounds
    missing, differing = [], []
    for spec in specs:
        name, bounds = _requirement(spec)
        if name == "dask[distributed]":
            assert conda.get("dask") == bounds and conda.get("distributed") == bounds, (bounds, conda)
        elif name not in conda:
            missing.append(spec)
        elif conda[name] != bounds:
            differing.append((spec, conda[name]))
    assert not missing, f"in pyproject.toml but not in environment.yml: {missing}"
    assert not differing, f"bounds differ between pyproject.toml and environment.yml: {differing}"


def test_mypy_checks_daskgen_and_skips_only_the_engines_large_libraries() -> None:
    """docs/architecture.md: mypy checks ``daskgen/`` and does not analyse torch, transformers or peft (their names
    are ``Any``); of the libraries daskgen imports, only the engines' and models' large ones are skipped."""
    import ast

    mypy = _pyproject()["tool"]["mypy"]
    assert mypy["files"] == ["daskgen"]
    skipped = {
        m.removesuffix(".*") for o in mypy["overrides"] if o.get("follow_imports") == "skip" for m in o["module"]
    }
    assert {"torch", "transformers", "peft"} <= skipped, skipped
    imported = set()
    for path in (ROOT / "daskgen").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    assert skipped & imported <= {"torch", "transformers", "peft", "tensordict"}, skipped & imported
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert 'follow_imports = "skip"' in text and "torch, transformers, peft" in text
