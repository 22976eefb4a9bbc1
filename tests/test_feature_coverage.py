"""Every request feature a registered engine declares is proven in a CI lane, or on a GPU by validate_gpu.py.

Read from the code, not from a list kept beside it: each registered engine's ``features`` and ``features_by_arg``;
the conformance classes of ``tests/`` (their engine, the checks of :data:`daskgen.testing.features.CHECKS` they
hold and their ``not_applicable`` reasons) with the lane their marks put them in; the tests marked
``proves(engine, feature)`` (a feature without a conformance check: a policy refresh); and the list of features
checked only on a GPU in ``docs/engines.md``, each with the ``benchmarks/validate_gpu.py`` options
(:data:`FEATURE_FLAGS`) that check it.  No engine is started.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from typing import Any

from daskgen.engines import available_engines, get_engine_class
from daskgen.engines.features import FEATURES
from daskgen.testing.conformance import EngineConformance
from daskgen.testing.features import CHECKS
from tests.conftest import REPO

#: The markers that put a test in a CI lane (no lane runs ``gpu``).
LANE_MARKERS = ("sglang", "vllm")
GPU_SECTION = "### Checked on a GPU only"
GPU_LINE = re.compile(r"^- `(\w+)` `(\w+)`: `python benchmarks/validate_gpu\.py --engine (\w+) ([^`]*)`")


def lane(marks: set[str]) -> str | None:
    """The CI lane a test with these marker names runs in (``None``: none, a ``gpu`` test)."""
    if "gpu" in marks:
        return None
    return next((name for name in LANE_MARKERS if name in marks), "main")


def _listed(found: Any) -> list[Any]:
    return list(found) if isinstance(found, list) else [found]


def _marks(obj: Any) -> list[Any]:
    return _listed(getattr(obj, "pytestmark", []))


def _class_marks(cls: type) -> list[Any]:
    return [mark for klass in cls.__mro__ for mark in _listed(klass.__dict__.get("pytestmark", []))]


def feature_test_modules() -> Iterator[Any]:
    """The test modules that hold conformance classes or ``proves`` marks, imported."""
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text()
        if "EngineConformance" in text or "mark.proves" in text:
            yield importlib.import_module(f"tests.{path.stem}")


def conformance_proofs(module: Any) -> Iterator[tuple[str, str, str, str]]:
    """``(engine, feature, lane, test)`` for each applicable feature check of the module's conformance classes."""
    module_marks = _marks(module)
    for name, cls in vars(module).items():
        if not (name.startswith("Test") and isinstance(cls, type) and issubclass(cls, EngineConformance)):
            continue
        where = lane({m.name for m in module_marks + _class_marks(cls)})
        for check, feature in CHECKS.items():
            if where is not None and hasattr(cls, check) and check not in cls.not_applicable:
                yield cls.engine_class.name, feature, where, f"{module.__name__}::{name}::{check}"


def marked_proofs(module: Any) -> Iterator[tuple[str, str, str, str]]:
    """``(engine, feature, lane, test)`` for each test of the module marked ``proves(engine, feature)`` (on the
    test, or on one of its parameters)."""
    module_marks = _marks(module)
    owners: list[tuple[str, Any, list[Any]]] = [(n, f, []) for n, f in vars(module).items() if n.startswith("test_")]
    for name, cls in vars(module).items():
        if name.startswith("Test") and isinstance(cls, type):
            owners += [(f"{name}::{n}", getattr(cls, n), _class_marks(cls)) for n in dir(cls) if n.startswith("test_")]
    for name, function, outer in owners:
        own = _marks(function)
        variants = [own]
        for mark in own:
            if mark.name == "parametrize":
                variants += [own + list(getattr(p, "marks", ())) for p in mark.args[1]]
        for marks in variants:
            where = lane({m.name for m in module_marks + outer + marks})
            for mark in marks:
                if mark.name == "proves" and where is not None:
                    yield mark.args[0], mark.args[1], where, f"{module.__name__}::{name}"


def gpu_only() -> dict[tuple[str, str], tuple[str, list[str]]]:
    """``{(engine, feature): (validate_gpu engine, options)}`` from docs/engines.md's list of GPU-only checks."""
    text = (REPO / "docs" / "engines.md").read_text()
    assert GPU_SECTION in text, f"docs/engines.md has no {GPU_SECTION!r} section"
    section = text.split(GPU_SECTION, 1)[1].split("\n#", 1)[0]
    found = {}
    for line in section.splitlines():
        if match := GPU_LINE.match(line):
            engine, feature, script_engine, flags = match.groups()
            found[(engine, feature)] = (script_engine, flags.split())
    assert found, f"no '- `engine` `feature`: `python benchmarks/validate_gpu.py ...`' line under {GPU_SECTION!r}"
    return found


def test_every_declared_feature_is_proven_in_a_lane_or_on_a_gpu() -> None:
    from benchmarks import validate_gpu

    proofs: dict[tuple[str, str], list[str]] = {}
    for module in feature_test_modules():
        for engine, feature, where, test in [*conformance_proofs(module), *marked_proofs(module)]:
            assert feature in FEATURES, f"{test} proves {feature!r}, which is no feature of {sorted(FEATURES)}"
            proofs.setdefault((engine, feature), []).append(f"{where} lane: {test}")
    declared = {
        (name, feature)
        for name in available_engines()
        for feature in (*get_engine_class(name).features, *get_engine_class(name).features_by_arg)
    }
    on_gpu = gpu_only()
    for (engine, feature), (script_engine, flags) in on_gpu.items():
        assert (engine, feature) in declared, f"docs/engines.md lists {engine} {feature} as GPU-only; not declared"
        assert (engine, feature) not in proofs, (f"{engine} {feature} is proven in a lane", proofs[(engine, feature)])
        assert script_engine == engine and set(validate_gpu.FEATURE_FLAGS[feature]) <= set(flags), (engine, flags)
        validate_gpu.parse_args(["--engine", engine, "--model", "m", *flags])  # the options exist
    unproven = sorted(declared - proofs.keys() - on_gpu.keys())
    assert not unproven, (
        f"declared features no CI lane proves and docs/engines.md does not list as checked on a GPU: {unproven}"
    )
    assert {"main", "sglang", "vllm"} <= {p.split(" ")[0] for found in proofs.values() for p in found}


def test_a_check_skipped_as_not_applicable_proves_nothing() -> None:
    """The derivation itself: a class declaring a check not applicable, or marked ``gpu``, proves nothing by it."""
    import tests.test_engine_sglang as module

    found = {(engine, feature): test for engine, feature, _, test in conformance_proofs(module)}
    assert ("sglang", "lora") not in found and ("sglang", "top_logprobs") in found, found
    assert not any("CUDA" in test for test in found.values()), found
    assert lane({"gpu", "sglang"}) is None and lane({"vllm", "slow"}) == "vllm" and lane({"slow"}) == "main"
