"""The main lane hands its processes the longest measured modules first (tests/module_order.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from tests import module_order
from tests.conftest import REPO


def test_modules_go_longest_first_and_keep_their_tests_and_ties_in_order() -> None:
    ids = ["tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::K::t1", "tests/d.py::t", "tests/c.py::t2"]
    order = module_order.longest_first(ids, {"tests/b.py": 5.0, "tests/c.py": 50.0, "tests/a.py": 5.0})
    assert [ids[i] for i in order] == [
        "tests/c.py::K::t1",
        "tests/c.py::t2",
        "tests/a.py::t1",  # a tie with b: a was collected first
        "tests/a.py::t2",
        "tests/b.py::t1",
        "tests/d.py::t",  # not measured: last
    ]


def test_checks_named_last_go_behind_the_rest_of_their_class_and_nothing_else_moves() -> None:
    groups = ["a.py::K", "a.py::K", "a.py::K", "a.py", "b.py::L", "b.py::L"]
    last = [False, True, False, False, True, False]
    assert module_order.named_last([0, 1, 2, 3, 4, 5], last, groups) == [0, 2, 1, 3, 5, 4]
    assert module_order.named_last([3, 2, 1, 0, 5, 4], last, groups) == [3, 2, 0, 1, 5, 4]
    assert module_order.named_last([0, 2, 3], [False] * 6, groups) == [0, 2, 3]


def test_a_conformance_class_shuts_its_engine_down_in_its_last_check() -> None:
    """Collected in the project's order, a conformance class's shutdown check comes after its other checks."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/test_engine_vllm.py::TestVLLMConformance"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    names = [ln.rsplit("::", 1)[1] for ln in out.stdout.splitlines() if "::" in ln and ": " not in ln]
    assert len(names) > 20 and names[-1] == "test_shutdown_is_idempotent", out.stdout[-3000:] + out.stderr[-2000:]


def test_stored_seconds_replace_the_modules_run_and_keep_the_others(tmp_path) -> None:
    path = tmp_path / "seconds.json"
    path.write_text(json.dumps({"tests/a.py": 1.0, "tests/b.py": 2.0}))
    module_order.store_seconds({"tests/b.py": 7.25, "tests/c.py": 3.04}, path)
    assert module_order.read_seconds(path) == {"tests/a.py": 1.0, "tests/b.py": 7.2, "tests/c.py": 3.0}
    assert module_order.read_seconds(tmp_path / "missing.json") == {}


def test_the_shipped_seconds_name_existing_modules() -> None:
    seconds = module_order.read_seconds()
    assert seconds, "tests/module_seconds.json is empty"
    missing = [module for module in seconds if not (REPO / module).is_file()]
    assert not missing, f"tests/module_seconds.json names modules that no longer exist: {missing}"


def test_the_main_lane_keeps_the_sorted_order_and_a_longer_module_is_collected_first() -> None:
    """xdist would reorder modules by their number of tests unless told not to; the collection puts the module
    measured longer first although it is named later."""
    (line,) = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.startswith("python -m pytest")]
    args = shlex.split(line)[3:]
    assert "--no-loadscope-reorder" in args and args[args.index("--dist") + 1] == "loadscope"
    seconds = module_order.read_seconds()
    short, long = "tests/test_analysis.py", "tests/test_preemption.py"
    assert seconds[short] < seconds[long]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", short, long],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    modules = [module_order.module_of(ln) for ln in out.stdout.splitlines() if "::" in ln]
    assert modules and modules[0] == long and modules[-1] == short, out.stdout[-2000:] + out.stderr[-2000:]
