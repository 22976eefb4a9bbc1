"""The prefix-dispatch benchmark names the engine settings each side ran with, so a record cannot hide that the
two sides ran different engine schedules (sglang under ``lpm`` on the prefix side, ``fcfs`` in input order)."""

from __future__ import annotations

import importlib

import pytest

from tests.conftest import REPO


@pytest.fixture
def bench(monkeypatch):
    """``benchmarks/prefix_dispatch.py`` as a module (its own imports resolve from ``benchmarks/``)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return importlib.import_module("prefix_dispatch")


def side(mode: str, engine_args: dict) -> dict:
    """One run's result as ``one_run`` returns it, with made-up measures."""
    return {
        "mode": mode,
        "tasks": 4,
        "engine_args": engine_args,
        "prefill": 1000,
        "makespan": 10.0,
        "tokens_s": 5.0,
        "prompt": 2000,
        "batch": None,
        "busy": None,
        "short": 0,
    }


def test_applied_args_add_the_engines_prefix_admission(bench):
    """A run dispatched by prefix starts sglang under ``lpm`` unless the run set a policy; input order keeps the
    run's arguments; an engine without a prefix admission of its own keeps them too."""
    assert bench.applied_args("sglang", {"device": "cpu"}, "prefix") == {"device": "cpu", "schedule_policy": "lpm"}
    assert bench.applied_args("sglang", {"schedule_policy": "fcfs"}, "prefix") == {"schedule_policy": "fcfs"}
    assert bench.applied_args("sglang", {"device": "cpu"}, "order") == {"device": "cpu"}
    assert bench.applied_args("vllm", {"max_num_seqs": 4}, "prefix") == {"max_num_seqs": 4}


def test_table_row_names_engine_args_that_differ_between_sides(bench):
    """The sides cell names every engine argument the two sides started with differently, or the shared policy."""
    order = side("order", bench.applied_args("sglang", {}, "order"))
    prefix = side("prefix", bench.applied_args("sglang", {}, "prefix"))
    cell = bench.table_row("w", 2, 0, [order], [prefix])[3]
    assert "engine args differ: schedule_policy A None, B lpm" in cell, cell
    same = {"schedule_policy": "lpm"}
    cell = bench.table_row("w", 2, 0, [side("order", same)], [side("prefix", same)])[3]
    assert "differ" not in cell and "schedule_policy lpm on both" in cell, cell
